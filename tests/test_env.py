"""Environment variables are documented overrides read in one place (issue K): megatron_burst.env.

No other module of the package reads a MEGATRON_BURST_* variable, every variable env.py reads is in
the README's table, and a malformed value is refused naming the variable and the accepted values."""
import pathlib
import re

import pytest

from megatron_burst import env

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_only_env_reads_megatron_burst_variables():
    offenders = []
    for path in sorted((ROOT / "megatron_burst").rglob("*.py")):
        if path.name == "env.py" and path.parent.name == "megatron_burst":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if re.search(r"(environ|getenv)\b", code) and "MEGATRON_BURST_" in code:
                offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
            if re.search(r"os\.environ(\.get|\[)\s*\(?\s*[A-Z_]*ENV\b", code):  # a constant holding a name
                offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offenders, "read MEGATRON_BURST_* through megatron_burst.env:\n" + "\n".join(offenders)


def test_every_variable_is_in_the_readme_table():
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Environment variables"):]
    missing = [name for name in env.VARIABLES if f"`{name}" not in table]
    assert not missing, f"README's environment table lacks {missing}"


def test_values_are_read_when_asked_and_validated(monkeypatch):
    monkeypatch.setenv("MEGATRON_BURST_ALLOW_SLOW_KERNELS", "1")
    assert env.allow_slow_kernels() is True
    monkeypatch.setenv("MEGATRON_BURST_ALLOW_SLOW_KERNELS", " 0 ")
    assert env.allow_slow_kernels() is False
    monkeypatch.delenv("MEGATRON_BURST_ALLOW_SLOW_KERNELS")
    assert env.allow_slow_kernels() is None
    monkeypatch.setenv("MEGATRON_BURST_ALLOW_SLOW_KERNELS", "yes")
    with pytest.raises(ValueError, match="MEGATRON_BURST_ALLOW_SLOW_KERNELS='yes': use 1"):
        env.allow_slow_kernels()
    monkeypatch.setenv("MEGATRON_BURST_SPARSE_TILE", "0")
    with pytest.raises(ValueError, match="MEGATRON_BURST_SPARSE_TILE='0'"):
        env.sparse_tile()
    monkeypatch.setenv("MEGATRON_BURST_SPARSE_TILE", "32")
    assert env.sparse_tile() == 32
    monkeypatch.setenv("MEGATRON_BURST_LINEAR_KERNEL", "")
    assert env.linear_kernel() is None
