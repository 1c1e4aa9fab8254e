"""``python -m spark_state``: the operations CLI (``spark_state.cli``)."""

from spark_state.cli import main

main()
