"""The operator console (``runlog ui``): an optional extra, ``pip install 'runlog[ui]'``.

Nothing below the shell imports it; ``runlog.cli`` loads it only when the console is asked
for, so a deployment without Starlette, uvicorn and Jinja2 runs everything else.
"""
