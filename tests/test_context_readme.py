"""Every Python block of README.md runs as written (in order, in a fresh interpreter),
and the public names it mentions resolve after ``import dualmode as dm``."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "OMPI_", "RANK_", "DEVICE_ID"))}
    env["PYTHONPATH"] = ROOT
    return env


def test_readme_python_blocks_run_as_written(tmp_path):
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as fh:
        blocks = re.findall(r"```python\n(.*?)```", fh.read(), re.S)
    assert len(blocks) >= 2
    script = tmp_path / "readme.py"
    script.write_text("\n".join(blocks) + "\nprint('readme ok')\n")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "AllReduce" in proc.stdout and proc.stdout.rstrip().endswith("readme ok")


def test_readme_names_resolve_without_extra_imports(tmp_path):
    code = ("import dualmode as dm\n"
            "assert dm.parallel.auto_parallel.AutoParallel is not None\n"
            "assert callable(dm.parallel.set_layerwise_slices)\n"
            "assert callable(dm.parallel.local_shape) and callable(dm.communication.init)\n"
            "assert dm.dataset.NumpySlicesDataset and dm.train.Model\n"
            "assert dm.nn.utils.no_init_parameters\n"
            "print('names ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "names ok" in proc.stdout, proc.stderr[-3000:]
