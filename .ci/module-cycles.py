#!/usr/bin/env python3
"""Finds dependency cycles between the modules of each crate.

Module A depends on module B when code in A names an item that B defines: `use` paths and
inline paths (`crate::x::y`, `super::z`, a child module's name) are resolved through
re-exports (`pub use`) to the module that defines the item. Declaring a child module, or
re-exporting its items, is not a dependency. A cycle means two modules can only be read
together; the crate graph must have none.

    .ci/module-cycles.py            # every crate of the workspace; exit 1 on a cycle
    .ci/module-cycles.py --edges    # also print every edge
"""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ITEM = re.compile(
    r"^\s*(?:#\[[^\]]*\]\s*)*(?:pub(?:\([^)]*\))?\s+)?(?:unsafe\s+|async\s+|const\s+|extern\s+\"C\"\s+)*"
    r"(fn|struct|enum|trait|type|const|static|union|mod)\s+([A-Za-z_][A-Za-z0-9_]*)"
)
MACRO = re.compile(r"^\s*macro_rules!\s+([A-Za-z_][A-Za-z0-9_]*)")
PATH = re.compile(r"(?<![A-Za-z0-9_:])([a-z_][A-Za-z0-9_]*(?:\s*::\s*[A-Za-z_][A-Za-z0-9_]*)+)")


def strip_test_modules(text):
    """Source without inline `#[cfg(test)] mod x { ... }` blocks: tests may use anything."""
    out, i = [], 0
    pat = re.compile(r"#\[cfg\(test\)\]\s*(?:#\[[^\]]*\]\s*)*mod\s+[A-Za-z_][A-Za-z0-9_]*\s*\{")
    while True:
        m = pat.search(text, i)
        if not m:
            out.append(text[i:])
            return "".join(out)
        out.append(text[i:m.start()])
        depth, j = 1, m.end()
        while j < len(text) and depth:
            if text[j] == "{":
                depth += 1
            elif text[j] == "}":
                depth -= 1
            j += 1
        out.append("\n" * text[m.start():j].count("\n"))
        i = j


def strip_comments_and_strings(text):
    """Source without comments, string and char literals (their contents blanked)."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if text.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif text.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    i += 1
        elif c == "r" and re.match(r'r#*"', text[i:i + 10]) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            m = re.match(r'r(#*)"', text[i:])
            end = text.find('"' + m.group(1), i + len(m.group(0)))
            out.append('""')
            i = n if end < 0 else end + 1 + len(m.group(1))
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append('""')
            i = j + 1
        elif c == "'" and re.match(r"'(\\.|[^\\'])'", text[i:i + 4]) or (c == "'" and text.startswith("'\\u{", i)):
            j = text.find("'", i + 1)
            out.append("' '")
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


class Module:
    def __init__(self, path, file):
        self.path = path  # tuple of names from the crate root
        self.file = file
        self.children = {}  # name -> Module
        self.items = set()
        self.reexports = {}  # name -> absolute path tuple (or ('*', path))
        self.globs = []  # absolute module paths re-exported with `pub use x::*`
        self.uses = []  # (path tuple relative spec, is_pub)
        self.inline_paths = []
        self.parent = None

    def name(self):
        return "::".join(self.path) or "crate"


def expand_use(tree):
    """`a::{b, c::{d, self}}` into [['a','b'], ['a','c','d'], ['a','c']] (aliases dropped)."""
    tree = re.sub(r"\s+", "", tree)

    def parse(s, prefix):
        paths = []
        depth, start = 0, 0
        parts = []
        for i, ch in enumerate(s):
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
            elif ch == "," and depth == 0:
                parts.append(s[start:i])
                start = i + 1
        parts.append(s[start:])
        for part in parts:
            if not part:
                continue
            if "{" in part:
                head, body = part.split("{", 1)
                body = body[: body.rfind("}")]
                head = [h for h in head.split("::") if h]
                paths.extend(parse(body, prefix + head))
            else:
                segs = part.split("::")
                last = segs[-1].split("as")[0] if "as" in segs[-1] and not segs[-1].startswith("as") else segs[-1]
                if re.match(r".+as[A-Za-z_]", segs[-1]):
                    last = re.split(r"as(?=[A-Za-z_])", segs[-1])[0]
                    alias = re.split(r"as(?=[A-Za-z_])", segs[-1])[1]
                else:
                    alias = None
                full = prefix + segs[:-1] + [last]
                if full and full[-1] == "self":
                    full = full[:-1]
                paths.append((full, alias))
        return paths

    return parse(tree, [])


def load_crate(src):
    root = Module((), src / ("lib.rs" if (src / "lib.rs").exists() else "main.rs"))
    modules = {(): root}

    def walk(m):
        text = strip_test_modules(strip_comments_and_strings(m.file.read_text()))
        depth = 0
        lines = text.split("\n")
        stmt = ""
        for line in lines:
            if stmt:
                stmt += line + " "
                if ";" in line:
                    finish_use(m, stmt)
                    stmt = ""
            elif depth == 0:
                im = ITEM.match(line)
                if im:
                    kind, name = im.groups()
                    if kind == "mod" and line.rstrip().endswith(";"):
                        child = find_child_file(m, name)
                        if child:
                            c = Module(m.path + (name,), child)
                            c.parent = m
                            m.children[name] = c
                            modules[c.path] = c
                    else:
                        m.items.add(name)
                mm = MACRO.match(line)
                if mm:
                    m.items.add(mm.group(1))
                if re.match(r"^\s*(#\[[^\]]*\]\s*)*(pub(\([^)]*\))?\s+)?use\s", line):
                    stmt = line + " "
                    if ";" in line:
                        finish_use(m, stmt)
                        stmt = ""
            depth += line.count("{") - line.count("}")
            for p in PATH.findall(line):
                segs = [s.strip() for s in p.split("::")]
                m.inline_paths.append(segs)
        for c in list(m.children.values()):
            walk(c)

    def finish_use(m, stmt):
        is_pub = bool(re.match(r"^\s*(#\[[^\]]*\]\s*)*pub", stmt))
        body = re.sub(r"^\s*(#\[[^\]]*\]\s*)*(pub(\([^)]*\))?\s+)?use\s+", "", stmt)
        body = body[: body.index(";")]
        for path, alias in expand_use(body):
            m.uses.append((path, is_pub, alias))

    def find_child_file(m, name):
        base = m.file.parent if m.file.name in ("lib.rs", "main.rs", "mod.rs") else m.file.parent / m.file.stem
        for cand in (base / f"{name}.rs", base / name / "mod.rs"):
            if cand.exists():
                return cand
        return None

    walk(root)
    return modules


def resolve_start(m, segs, modules):
    """The module a path starts from, and the rest of the path."""
    if not segs:
        return None, []
    head = segs[0]
    if head == "crate":
        return modules[()], segs[1:]
    if head == "self":
        return m, segs[1:]
    if head == "super":
        cur = m
        while segs and segs[0] == "super":
            cur = cur.parent
            segs = segs[1:]
            if cur is None:
                return None, []
        return cur, segs
    if head in m.children:
        return m, segs
    # An item imported into this module by name (`use super::ar; ar::X`).
    for path, _, alias in m.uses:
        if path and (alias or path[-1]) == head and path[0] in ("crate", "super", "self") or (path and path[0] in m.children and (alias or path[-1]) == head):
            start, rest = resolve_start(m, path, modules)
            if start is not None:
                return start, rest + segs[1:]
    return None, []


def definer(start, segs, modules, seen=None):
    """The module defining the item `segs` names from `start`."""
    seen = seen or set()
    cur = start
    for i, s in enumerate(segs):
        key = (cur.path, tuple(segs[i:]))
        if key in seen:
            return None
        seen.add(key)
        if s in cur.children:
            cur = cur.children[s]
            continue
        if s in cur.items:
            return cur
        for path, is_pub, alias in cur.uses:
            if (alias or (path[-1] if path else None)) == s and path and path[-1] != "*":
                st, rest = resolve_start(cur, path, modules)
                if st is None:
                    return None
                return definer(st, rest + segs[i + 1:], modules, seen)
        for path, is_pub, alias in cur.uses:
            if path and path[-1] == "*":
                st, rest = resolve_start(cur, path[:-1], modules)
                if st is None:
                    continue
                target = definer(st, rest, modules, seen) if rest else st
                if target is not None:
                    got = definer(target, [s] + segs[i + 1:], modules, seen)
                    if got is not None:
                        return got
        return None
    return cur


def edges(modules):
    out = {}
    for m in modules.values():
        deps = set()
        candidates = []
        for path, is_pub, alias in m.uses:
            if is_pub:
                continue  # a re-export is not a dependency of the re-exporting module
            candidates.append(path)
        candidates += m.inline_paths
        for segs in candidates:
            if not segs or segs[-1] == "*":
                segs = segs[:-1]
                if not segs:
                    continue
            start, rest = resolve_start(m, segs, modules)
            if start is None:
                continue
            target = definer(start, rest, modules) if rest else start
            if target is None or target is m:
                continue
            # Naming a module itself (`use super::ar;`) depends on it only through what is used.
            if rest and target.path == tuple(start.path) + tuple(rest):
                continue
            # An item of one's own descendant or ancestor module defined inline is still an edge.
            deps.add(target.path)
        out[m.path] = deps
    return out


def cycles(graph):
    index, low, stack, on, result = {}, {}, [], set(), []
    counter = [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                result.append(comp)

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            strong(v)
    return result


def crates():
    for toml in sorted(ROOT.glob("**/Cargo.toml")):
        if "target" in toml.parts or toml.parent == ROOT:
            continue
        src = toml.parent / "src"
        if (src / "lib.rs").exists():
            yield toml.parent.name, src
        elif (src / "main.rs").exists():
            yield toml.parent.name, src


def main():
    show = "--edges" in sys.argv
    bad = 0
    for name, src in crates():
        modules = load_crate(src)
        graph = edges(modules)
        if show:
            for v, ws in sorted(graph.items()):
                for w in sorted(ws):
                    print(f"{name}: {'::'.join(v) or 'crate'} -> {'::'.join(w) or 'crate'}")
        for comp in cycles(graph):
            bad += 1
            names = sorted("::".join(p) or "crate" for p in comp)
            print(f"{name}: cycle between {', '.join(names)}")
            for v in comp:
                for w in sorted(graph[v]):
                    if w in comp:
                        print(f"    {'::'.join(v) or 'crate'} -> {'::'.join(w) or 'crate'}")
    if bad:
        print(f"{bad} module cycle(s)")
        return 1
    print("no module cycles")
    return 0


if __name__ == "__main__":
    sys.exit(main())
