"""The live web dashboard (`moe-lab dashboard`): a read-only FastAPI server over run directories
(`server.py`, `runs.py`) and a Svelte app built into `static/` from `web/`."""
