"""The README's Python example, run as written: the first ```python block of
README.md, with only its base_url pointed at the server under test
($SPECGATE_URL, e.g. http://127.0.0.1:PORT/v1). It must stream some text and
end without an exception. Run by scripts/test-openai.sh on the default config
(the one the README serves), with the official `openai` package."""
import contextlib
import io
import os
import pathlib
import re
import sys

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
if not blocks:
    sys.exit("README.md has no ```python block")
snippet = blocks[0]
WRITTEN = "http://127.0.0.1:8000/v1"
if WRITTEN not in snippet:
    sys.exit(f"the README's example no longer points at {WRITTEN}; update this test")
snippet = snippet.replace(WRITTEN, os.environ["SPECGATE_URL"])
out = io.StringIO()
with contextlib.redirect_stdout(out):
    exec(compile(snippet, "README.md", "exec"), {})
text = out.getvalue()
if not text.strip():
    sys.exit("the README's example streamed no text")
print(f"README python example: {len(text)} characters streamed")
