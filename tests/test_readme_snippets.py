"""The README's quick start, run as a reader runs it: its shell block and then its Python
block, copied literally, in a fresh shell and a fresh Python, in an empty directory. The shell
block writes a tiny checkpoint with the package and starts a real agent on it (the cpu backend
on a machine without a GPU); the Python block attaches to that agent and generates."""
from __future__ import annotations

import ast
import builtins
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

from test_first_day import stop_session

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def quick_start() -> tuple[str, str]:
    """The first ```bash and the first ```python block of the README's quick start."""
    body = README.split("\n## Quick start: an agent and an engine", 1)[1].split("\n## ", 1)[0]
    shell = re.findall(r"```bash\n(.*?)```", body, re.DOTALL)[0]
    python = re.findall(r"```python\n(.*?)```", body, re.DOTALL)[0]
    return shell, python


def test_the_quick_start_blocks_are_self_contained():
    """Nothing in them is left for the reader to define: every name the Python block uses is
    imported or assigned in it, and the shell block makes the checkpoint and the socket it names."""
    shell, python = quick_start()
    tree = ast.parse(python)
    defined = {alias.asname or alias.name.split(".")[0] for node in ast.walk(tree)
               if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names}
    defined |= {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)}
    used = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}
    assert used - defined - set(dir(builtins)) == set()
    model = re.search(r'CacheSpec\(model="([^"]+)"\)', python).group(1)
    socket = re.search(r'socket="([^"]+)"', python).group(1)
    assert f'write_llama_checkpoint("{model}")' in shell
    assert re.search(rf"^weightcache agent --model {re.escape(model)} --socket {re.escape(socket)} &$", shell, re.MULTILINE)


def test_the_quick_start_runs_as_written_against_a_real_agent():
    shell, python = quick_start()
    bindir = os.path.dirname(sys.executable)
    env = dict(os.environ, PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}")
    env.pop("WEIGHTCACHE_SOCKET", None)
    if shutil.which("weightcache", path=env["PATH"]) is None:
        pytest.skip("the README's commands need the installed `weightcache` command (pip install)")
    work = pathlib.Path(tempfile.mkdtemp(prefix="wc-readme-"))  # short: the socket path fits 107 bytes
    try:
        (work / "quick_start.py").write_text(python)
        script = f"set -e\n{shell}\npython quick_start.py\n"
        with open(work / "out", "w+") as out_file, open(work / "err", "w+") as err_file:
            # files, not pipes: the agent the block leaves running keeps its output open
            shell_proc = subprocess.Popen(["bash", "-c", script], cwd=work, stdout=out_file, stderr=err_file,
                                          env=env, start_new_session=True)
            try:
                shell_proc.wait(timeout=120)
            finally:
                stop_session(shell_proc.pid)  # the agent the block started in the background
        out, err = (work / "out").read_text(), (work / "err").read_text()
        assert shell_proc.returncode == 0, (out, err[-3000:])

        # `weightcache status` found the agent ready; the engine attached to it, zero-copy
        assert re.search(r"^PHASE\s+ready$", out, re.MULTILINE), out
        attachment = next(line for line in out.splitlines() if line.startswith("Attachment("))
        promised = re.search(r"print\(att\)\s+# (.*?)\.\.\.\)", python).group(1)  # the README's comment
        assert attachment.startswith(promised), (attachment, promised)
        assert "attached pid=" in err and "shut down cleanly" in err, err[-3000:]

        # the tokens it printed are the model's: the same as a load from disk in this process
        tokens = ast.literal_eval(out.strip().splitlines()[-1])
        import torch

        from weightcache_agent import CacheSpec, attach
        from weightcache_agent.engine.model import CausalLM, ModelConfig

        prompt, max_tokens = re.search(r"generate\((\[[\d, ]+\]), max_tokens=(\d+)\)", python).groups()
        config = ModelConfig.from_pretrained(str(work / "tiny-llama"))
        with torch.device("meta"):
            model = CausalLM(config).eval()
        attach(model, CacheSpec(model=str(work / "tiny-llama")), mode="off")
        model.prepare()
        assert tokens == model.generate(ast.literal_eval(prompt), max_tokens=int(max_tokens))
        assert len(tokens) == int(max_tokens)
    finally:
        shutil.rmtree(work, ignore_errors=True)
