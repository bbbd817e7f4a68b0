"""The notebooks run headless, top to bottom, without errors (nbclient, kernel python3)."""
import json
import os
import sys
from pathlib import Path

import pytest
from conveyor.testing import STORIES_DIR  # noqa: E402

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")

NB_DIR = Path(__file__).resolve().parents[1] / "notebooks"
STORIES = STORIES_DIR


@pytest.fixture()
def kernel_env(tmp_path, monkeypatch):
    """A python3 kernelspec that runs this interpreter, found first through JUPYTER_PATH,
    so the test needs no registered kernel; the kernel inherits the environment
    (PYTHONPATH included)."""
    spec = tmp_path / "jupyter" / "kernels" / "python3"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (conveyor tests)", "language": "python"}))
    old = os.environ.get("JUPYTER_PATH")
    monkeypatch.setenv("JUPYTER_PATH", os.pathsep.join([str(tmp_path / "jupyter")] + ([old] if old else [])))
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    if "CONVEYOR_STORIES" not in os.environ and STORIES.is_dir():
        monkeypatch.setenv("CONVEYOR_STORIES", str(STORIES))
    # the kernel imports conveyor from wherever this process does
    import conveyor

    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(conveyor.__file__)))  # symlinks kept
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if pkg_root not in paths:
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join([pkg_root] + paths))


def _run(name: str):
    nb = nbformat.read(NB_DIR / name, as_version=4)
    for cell in nb.cells:  # committed without outputs
        if cell.cell_type == "code":
            assert not cell.get("outputs") and cell.get("execution_count") is None, name
    client = nbclient.NotebookClient(nb, timeout=240, kernel_name="python3",
                                     resources={"metadata": {"path": str(NB_DIR)}})
    client.execute()
    outs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outs if o.output_type == "error"]
    return nb, outs


def _text(outs):
    return "".join(o.get("text", "") for o in outs if o.output_type == "stream")


def test_quickstart_notebook(kernel_env):
    nb, outs = _run("quickstart.ipynb")
    text = _text(outs)
    assert "finish reason" in text and "finished: True" in text
    assert "stopped after 5 outputs; running: 0 aborted: 1" in text


def test_continuous_batching_notebook(kernel_env, monkeypatch):
    monkeypatch.delenv("CONVEYOR_STORIES", raising=False)  # it runs on the copy the package ships
    nb, outs = _run("continuous_batching.ipynb")
    images = [o for o in outs if o.output_type == "display_data" and "image/png" in o.get("data", {})]
    assert len(images) >= 3  # timeline, variance, latency
    text = _text(outs)
    assert "slot 0" in text and "ratio" in text and "requests/s" in text
    assert "continuous    19 steps" in text and "static        30 steps" in text  # as its text says


def test_progress_bar_in_jupyter_does_not_warn(kernel_env):
    """LLM.generate's default progress bar inside a kernel: the widget bar when ipywidgets
    is installed, else tqdm's text bar, never tqdm's "IProgress not found" warning."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(
        "import os\n"
        "from conveyor import LLM, SamplingParams\n"
        "p = os.environ['CONVEYOR_STORIES']\n"
        "llm = LLM(p if p.endswith('.bin') else os.path.join(p, 'stories260K.bin'))\n"
        "outs = llm.generate(['Once upon a time'] * 3, SamplingParams(max_tokens=8))\n"
        "print('done', len(outs))\n")]
    if "CONVEYOR_STORIES" not in os.environ:
        pytest.skip("stories260K not found")
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3").execute()
    outs = nb.cells[0].outputs
    assert not [o for o in outs if o.output_type == "error"], outs
    text = "".join(o.get("text", "") for o in outs if o.output_type == "stream")
    assert "done 3" in text
    assert "IProgress" not in text, text
