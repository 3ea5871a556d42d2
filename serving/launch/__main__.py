"""python -m serving.launch: start tritonserver on the model repository (launcher.py)."""
import sys

from serving.launch.launcher import main

sys.exit(main())
