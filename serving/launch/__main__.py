"""python -m serving.launch: start tritonserver on the model repository (cli.py)."""
import sys

from serving.launch.cli import main

sys.exit(main())
