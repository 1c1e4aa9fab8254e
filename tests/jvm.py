"""The Java options of every JVM the tests start (the session's, the drivers', a cluster's daemons and executors).

The tests' JVMs live for seconds to minutes on small data, so starting them
dominates: C1 alone (no C2 compile threads) and the serial collector take
about half the CPU to start and leave it to the other test worker. Only the
tests use them: the benchmarks and ``./run main`` run Spark's defaults.
"""

JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
