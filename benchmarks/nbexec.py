"""Executes a notebook in a kernel that runs this very interpreter (`sys.executable`).

nbclient finds kernels by name through kernelspecs, and "python3" may resolve to some other Python
(a system-wide kernelspec, another environment) without jax or this repository. A kernelspec
written to a temporary directory and pointing at `sys.executable` avoids that on any machine,
including a fresh CI clone after `pip install -e .[test,bench]`.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import tempfile

KERNEL_NAME = "pallas_attn_bench"


def execute(nb, cwd, env: dict | None = None, timeout: int = 600):
  """Runs every cell of `nb` (an nbformat NotebookNode) in place, in directory `cwd`, with extra
  environment variables `env`; raises nbclient's CellExecutionError if a cell fails."""
  from jupyter_client.kernelspec import KernelSpecManager  # pylint: disable=import-outside-toplevel
  from jupyter_client.manager import KernelManager  # pylint: disable=import-outside-toplevel
  from nbclient import NotebookClient  # pylint: disable=import-outside-toplevel

  with tempfile.TemporaryDirectory() as tmp:
    spec_dir = pathlib.Path(tmp) / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (ipykernel)", "language": "python"}))
    km = KernelManager(kernel_name=KERNEL_NAME,
                       kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(spec_dir.parent)]))
    client = NotebookClient(nb, km=km, timeout=timeout,
                            resources={"metadata": {"path": str(cwd)}})
    client.execute(env={**os.environ, **(env or {})})
  # Keep the committed notebook's kernelspec the standard one, not the temporary name.
  nb.metadata["kernelspec"] = {"display_name": "Python 3 (ipykernel)", "language": "python",
                               "name": "python3"}
  return nb
