"""`python -m ember_calc_tool DIRECTORY`: write the task's tokenizer and prompts there."""

import sys

from ember_calc_tool.task import write_task_files

if len(sys.argv) != 2:
    sys.exit("usage: python -m ember_calc_tool DIRECTORY")
print(write_task_files(sys.argv[1]))
