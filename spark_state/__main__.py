"""``python -m spark_state``: the operations CLI (``spark_state.ops.cli``)."""

from spark_state.ops.cli import main

main()
