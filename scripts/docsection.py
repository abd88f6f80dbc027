"""Replace the text between `<!-- SECTION:begin -->` and `<!-- SECTION:end -->` in a
docs file: how the bench scripts write their figures into docs/ (imported by them)."""
import sys


def replace_section(path, section, text):
    begin, end = f"<!-- {section}:begin -->", f"<!-- {section}:end -->"
    doc = open(path).read()
    if begin not in doc or end not in doc:
        sys.exit(f"{path} has no {begin} ... {end} section")
    pre, rest = doc.split(begin, 1)
    open(path, "w").write(pre + begin + "\n" + text + end + rest.split(end, 1)[1])
