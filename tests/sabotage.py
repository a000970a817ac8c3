"""Issue 65's sabotage table, replayed: each case breaks one thing in a
tree, runs the default-tier tests that claim to guard it, expects them to
fail, and restores the file (docs/contributing.md, "Break it once").

    python tests/sabotage.py TREE   # a scratch worktree: its files are edited

TREE's own .venv/bin/python runs the tests where it has one (mlx_mtp
installed editable from TREE), else this interpreter."""
import subprocess, sys
from pathlib import Path

tree = Path(sys.argv[1])
python = tree / ".venv/bin/python" if (tree / ".venv/bin/python").exists() else sys.executable
CASES = [
    ("image features never placed at the pads (rows.Media.embeddings)",
     "mlx_mtp/rows.py", "        if len(at):\n            emb[0, mx.array(self.pads[at]",
     "        if False:\n            emb[0, mx.array(self.pads[at]",
     ["tests/test_images.py"]),
    ("the server reads every image as a black image of its size (server/images.py)",
     "mlx_mtp/server/images.py", "            return decode_image(raw, self.limits.max_pixels)\n",
     "            _i = decode_image(raw, self.limits.max_pixels)\n"
     "            from PIL import Image as _I\n            return _I.new(_i.mode, _i.size)\n",
     ["tests/test_server_images.py"]),
    ("every batch row takes the first row's M-RoPE shift (batch._concat)",
     "mlx_mtp/batch.py", "            a, b = filled(a), filled(b)\n    return DecodeState.concat(a, b)\n",
     "            a, b = filled(a), filled(b)\n    _o = DecodeState.concat(a, b)\n"
     "    if _o.rope_delta is not None:\n"
     "        _o = _o.replace(rope_delta=mx.broadcast_to(_o.rope_delta[:1], _o.rope_delta.shape))\n"
     "    return _o\n",
     ["tests/test_images.py", "-k", "batch"]),
    ("a damaged tower in a converted folder (convert._copy_tower)",
     "convert/convert.py", "    if not tensors:\n        return 0\n",
     "    if not tensors:\n        return 0\n    _k = sorted(tensors)[-1]\n"
     "    tensors[_k] = tensors[_k] * 1.01\n",
     ["tests/test_images.py", "-k", "convert"]),
]
ok = True
for what, path, old, new, tests in CASES:
    f = tree / path
    text = f.read_text()
    assert text.count(old) == 1, (path, old)
    f.write_text(text.replace(old, new))
    try:
        cmd = [str(python), "-m", "pytest", "-q", "-n0", "-x", *tests]
        r = subprocess.run(cmd, cwd=tree, capture_output=True, text=True)
        last = [l for l in r.stdout.splitlines() if l.strip()][-1]
        failed = [l for l in r.stdout.splitlines() if l.startswith(("FAILED", "ERROR"))]
        print(f"{what}\n  $ pytest -q -n0 -x {' '.join(tests)}\n  rc {r.returncode}: {last}\n  "
              + ("\n  ".join(failed[:3]) or "(no failure)"))
        ok &= r.returncode != 0
    finally:
        f.write_text(text)
print("every sabotage caught" if ok else "A SABOTAGE PASSED")
sys.exit(0 if ok else 1)
