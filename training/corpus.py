"""Which text the trained family learns from, and which text it never sees.

Training corpus (`select_corpus`): the Rust sources of the crates in the local cargo
registry (`~/.cargo/registry/src/*/`), chosen by a fixed rule:

1. one version per crate: the highest version (numeric compare of the version parts);
2. `*.rs` files only, in sorted path order within the crate;
3. a file is skipped when it is larger than MAX_FILE_BYTES, when more than
   MAX_LONG_LINE_SHARE of its lines are longer than LONG_LINE chars, when it is not
   UTF-8, or when its first 2 KB say it is generated ("@generated", "automatically
   generated", "do not edit");
4. exact duplicates (same bytes) are kept once;
5. at most MAX_CRATE_BYTES per crate (files taken in path order until the cap).

Held out (`project_sources`): this repository's own `*.rs` files at a fixed commit, which
training never reads; the held-out cross-entropy and the benchmark prompts come from them.
"""
import glob
import hashlib
import os
import re
import subprocess

MAX_FILE_BYTES = 128 * 1024
LONG_LINE = 160
MAX_LONG_LINE_SHARE = 0.02
MAX_CRATE_BYTES = 3_000_000
GENERATED = re.compile(r"@generated|automatically generated|do not edit", re.IGNORECASE)


def registry_root():
    roots = sorted(glob.glob(os.path.expanduser("~/.cargo/registry/src/*/")))
    if not roots:
        raise SystemExit("no ~/.cargo/registry/src/*/ folder: run `cargo fetch` in the repository first")
    return roots


def _version_key(v):
    """'1.2.10+extra' -> ((1, 2, 10), '+extra'): numeric parts first."""
    m = re.match(r"(\d+)\.(\d+)\.(\d+)(.*)", v)
    if not m:
        return ((0, 0, 0), v)
    return (tuple(int(x) for x in m.groups()[:3]), m.group(4))


def latest_crates():
    """{crate name: folder} keeping the highest version of every crate."""
    best = {}
    for root in registry_root():
        for d in sorted(os.listdir(root)):
            m = re.match(r"(.+?)-(\d+\.\d+\.\d+.*)$", d)
            if not m or not os.path.isdir(os.path.join(root, d)):
                continue
            name, ver = m.groups()
            if name not in best or _version_key(ver) > _version_key(best[name][0]):
                best[name] = (ver, os.path.join(root, d))
    return {name: path for name, (_, path) in sorted(best.items())}


def keep_file(text):
    if len(text.encode()) > MAX_FILE_BYTES or GENERATED.search(text[:2048]):
        return False
    lines = text.split("\n")
    long_lines = sum(len(line) > LONG_LINE for line in lines)
    return long_lines <= MAX_LONG_LINE_SHARE * len(lines)


def rs_files(folder):
    out = []
    for root, dirs, names in os.walk(folder):
        dirs.sort()
        out += [os.path.join(root, n) for n in names if n.endswith(".rs")]
    return sorted(out)


def read_text(path):
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (UnicodeDecodeError, OSError):
        return None


def select_corpus():
    """[(crate-version/relative/path, text)] in a fixed order."""
    seen = set()
    docs = []
    for name, folder in latest_crates().items():
        crate_bytes = 0
        for path in rs_files(folder):
            text = read_text(path)
            if text is None or not text.strip() or not keep_file(text):
                continue
            digest = hashlib.sha256(text.encode()).digest()
            if digest in seen:
                continue
            size = len(text.encode())
            if crate_bytes + size > MAX_CRATE_BYTES:
                break
            seen.add(digest)
            crate_bytes += size
            docs.append((os.path.relpath(path, os.path.dirname(folder.rstrip("/"))), text))
    return docs


def project_sources(repo, commit):
    """[(relative path, text)]: the repository's own *.rs files at `commit` (held out),
    read through git so later edits of the repository do not change the held-out set."""
    def git(*args):
        return subprocess.run(["git", "-C", repo, *args], check=True, capture_output=True).stdout

    names = git("ls-tree", "-r", "--name-only", commit).decode().splitlines()
    out = []
    for rel in sorted(n for n in names if n.endswith(".rs")):
        try:
            text = git("show", f"{commit}:{rel}").decode("utf-8")
        except UnicodeDecodeError:
            continue
        if text:
            out.append((rel, text))
    return out
