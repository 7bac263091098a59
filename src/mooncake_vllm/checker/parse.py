"""Read a deployment: launch scripts, Mooncake JSON configs, env files, directories.

Shell scripts are read, never run: logical lines (``\\`` continuations and
multi-line quotes), ``export VAR=…``, ``VAR=… cmd`` prefixes, ``&&``/``;``/``&``
separated commands, heredocs skipped. Bad input (unreadable, binary, too large,
invalid JSON, unterminated quotes) raises one :class:`ConfigError` listing every
bad path.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from collections.abc import Iterable, Mapping
from pathlib import Path

from mooncake_vllm.checker.model import (
    HOLDER,
    MASTER,
    METADATA,
    OTHER,
    PIP,
    PROXY,
    VLLM,
    Deployment,
    Launch,
    MooncakeConfigFile,
    Where,
)  # fmt: skip
from mooncake_vllm.config import CONFIG_ENV
from mooncake_vllm.errors import ConfigError, ConfigProblem, NotRegularFileError, TooLargeError
from mooncake_vllm.files import read_regular

__all__ = ["MAX_INPUT_BYTES", "parse_config_text", "parse_shell", "read_deployment"]

#: Largest file the checker reads (launch scripts and configs are small).
MAX_INPUT_BYTES = 4 << 20
MAX_FILES = 2000
_SKIP_DIRS = {".git", ".hg", ".svn", "__pycache__", "node_modules", ".venv", "venv", ".tox", "site-packages"}
_ASSIGN = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.DOTALL)
_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")
_SEPARATORS = {";", "&&", "||", "|", "&", "|&", ";;", "(", ")"}
_WRAPPERS = {"nohup", "exec", "time", "sudo", "setsid", "command", "builtin"}
_CONFIG_KEYS = {"metadata_server", "master_server_address", "local_hostname", "protocol", "device_name",
                "global_segment_size", "local_buffer_size", "prefill_url", "decode_url"}
#: proxies from vLLM / Mooncake examples (vllm §12)
LEGACY_PROXIES = {"disagg_proxy_demo.py", "disagg_demo.py", "proxy_demo.py", "mooncake_connector_proxy.py",
                  "toy_proxy_server.py", "vllm_v1_proxy_server.py", "disagg_prefill_proxy_server.py"}
_SHORT = {VLLM: {"-tp": "--tensor-parallel-size", "-dp": "--data-parallel-size", "-pp": "--pipeline-parallel-size"},
          PROXY: {"-m": "--model", "-p": "--prefill", "-d": "--decode"}}


# --------------------------------------------------------------------------- files
def _read_text(path: Path, problems: list[ConfigProblem], *, follow: bool = True) -> str | None:
    """The text of ``path`` if it is a regular file of at most MAX_INPUT_BYTES (counted on the bytes read);
    a FIFO never hangs the checker and a symlink to /dev/zero is refused, not read (:func:`read_regular`)."""
    name = str(path)
    try:
        data = read_regular(path, MAX_INPUT_BYTES, follow=follow)
    except NotRegularFileError:
        problems.append(ConfigProblem(name, "is not a regular file (a FIFO, device, socket or directory)",
                                      "pass the launch scripts and Mooncake configs themselves"))
        return None
    except TooLargeError as exc:
        problems.append(ConfigProblem(name, f"is larger than the {MAX_INPUT_BYTES >> 20} MiB the checker reads "
                                      f"({exc.size / (1 << 20):.0f} MiB or more)",
                                      "pass the launch scripts and Mooncake configs themselves"))
        return None
    except OSError as exc:
        problems.append(ConfigProblem(name, f"cannot be read ({exc.strerror or exc})",
                                      "check the path and its permissions"))
        return None
    try:
        if b"\x00" in data[:65536]:
            raise UnicodeDecodeError("utf-8", data[:1], 0, 1, "NUL byte")
        return data.decode("utf-8")
    except UnicodeDecodeError:
        problems.append(ConfigProblem(name, "is binary, not a text script or JSON config",
                                      "pass shell scripts, env files or mooncake*.json configs"))
        return None


def _kind_of(path: Path, text: str | None = None) -> str | None:
    """"json" | "env" | "shell" | None (not something the checker reads, in a directory walk)."""
    name = path.name.lower()
    if name.endswith(".json"):
        return "json"
    if name in (".env", "env") or name.endswith(".env") or name.startswith(".env."):
        return "env"
    if name.endswith((".sh", ".bash")):
        return "shell"
    if text is None or path.suffix.lower() not in ("", ".txt", ".conf", ".cfg", ".bashrc", ".profile"):
        return None
    return "json" if text.lstrip().startswith("{") else "shell"


def _walk(root: Path, problems: list[ConfigProblem]) -> list[Path]:
    """Candidate files under ``root``. Symlinks are never followed: one to a file inside ``root`` is
    skipped (the target is read itself), one out of ``root``, to a device or dangling is a problem;
    symlinked directories are not entered. Non-regular files are refused by :func:`_read_text`."""
    found: list[Path] = []
    inside = root.resolve()
    for dirpath, dirnames, filenames in os.walk(root, onerror=None, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        for filename in sorted(filenames):
            path = Path(dirpath, filename)
            kind = _kind_of(path)
            if kind == "json" and "mooncake" not in filename.lower():
                continue  # only Mooncake configs among a directory's JSON files
            if not kind:
                continue
            if path.is_symlink():
                target = path.resolve()
                if target.is_file() and target.is_relative_to(inside):
                    continue  # read as itself
                what = ("is a dangling symlink" if not target.exists() else
                        f"is a symlink to {target}, which is not a regular file inside {root}")
                problems.append(ConfigProblem(str(path), f"{what}; symlinks are not followed",
                                              "pass the file itself (or copy it into the directory)"))
                continue
            found.append(path)
    return found


def read_deployment(paths: Iterable[str | os.PathLike[str]], *, env: Mapping[str, str] | None = None) -> Deployment:
    """Read every PATH (files or directories) into one :class:`Deployment`.

    With no paths, the deployment is the current environment: one pseudo-instance
    with ``env`` (default ``os.environ``) and the config at ``$MOONCAKE_CONFIG_PATH``.
    """
    env = dict(os.environ if env is None else env)
    paths = [Path(p) for p in paths]
    problems: list[ConfigProblem] = []
    deployment = Deployment()
    if not paths:
        deployment.from_environment = True
        deployment.launches.append(Launch("environment", [], env, Where("environment")))
        cfg = env.get(CONFIG_ENV)
        if cfg:
            text = _read_text(Path(cfg), problems)
            if text is not None:
                _add_config(deployment, text, cfg, problems)
            if problems:
                problems = [ConfigProblem(CONFIG_ENV, f"{cfg!r} {p.problem}", p.fix) for p in problems]
        _raise(problems)
        return deployment
    files: list[tuple[Path, bool]] = []  # (path, follow a final symlink: only for paths given explicitly)
    for path in paths:
        if path.is_dir():
            files += [(p, False) for p in _walk(path, problems)]
        elif path.exists() or path.is_symlink():
            files.append((path, True))
        else:
            problems.append(ConfigProblem(str(path), "does not exist", "check the path"))
    if len(files) > MAX_FILES:
        problems.append(ConfigProblem(str(paths[0]), f"holds {len(files)} candidate files (limit {MAX_FILES})",
                                      "point the checker at the deployment's own directory"))
        _raise(problems)
    texts = [(p, _read_text(p, problems, follow=follow)) for p, follow in files]
    base_env: dict[str, str] = {}
    for path, text in texts:  # env files first: they are the environment of every script
        if text is not None and _kind_of(path, text) == "env":
            parse_shell(text, str(path), base_env, export_all=True)
    for path, text in texts:
        if text is None:
            continue
        kind = _kind_of(path, text)
        if kind is None:
            problems.append(ConfigProblem(str(path), "is not a shell script, env file or Mooncake JSON config",
                                          "pass *.sh launch scripts, *.env files or mooncake*.json configs"))
        elif kind == "json":
            _add_config(deployment, text, str(path), problems)
        elif kind == "shell":
            try:
                deployment.launches += parse_shell(text, str(path), dict(base_env))
            except ConfigError as exc:
                problems += exc.problems
        deployment.sources.append(str(path))
    _raise(problems)
    return deployment


def _raise(problems: list[ConfigProblem]) -> None:
    if problems:
        raise ConfigError("the given paths", problems)


def _add_config(deployment: Deployment, text: str, path: str, problems: list[ConfigProblem]) -> None:
    try:
        deployment.configs.append(parse_config_text(text, path))
    except ConfigError as exc:
        problems += exc.problems


def parse_config_text(text: str, path: str) -> MooncakeConfigFile:
    """Parse a Mooncake JSON config, remembering the line of each key."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(path, [ConfigProblem(path, f"is not valid JSON ({exc.msg} at line {exc.lineno} "
                                               f"column {exc.colno})", "fix the JSON syntax")]) from None
    if not isinstance(data, dict) or not (_CONFIG_KEYS & set(data)):
        raise ConfigError(path, [ConfigProblem(path, "is not a Mooncake config (no metadata_server, "
                                               "master_server_address, protocol, ... keys)",
                                               "pass mooncake.json / mooncake_config.json files")])
    lines = {}
    for key in data:
        m = re.search(r'"' + re.escape(key) + r'"\s*:', text)
        lines[key] = text.count("\n", 0, m.start()) + 1 if m else 0
    return MooncakeConfigFile(path, data, lines)


# --------------------------------------------------------------------------- shell
def _scan(line: str, quote: str | None) -> tuple[str, str | None]:
    """Strip a trailing ``# comment`` (outside quotes); return the text and the open quote."""
    out: list[str] = []
    i = 0
    while i < len(line):
        c = line[i]
        if quote is None and c == "#" and (i == 0 or line[i - 1].isspace()):
            break
        if c == "\\" and quote != "'":
            out.append(line[i:i + 2])
            i += 2
            continue
        if quote is None and c in "'\"":
            quote = c
        elif c == quote:
            quote = None
        out.append(c)
        i += 1
    return "".join(out), quote


def _logical_lines(text: str, path: str) -> Iterable[tuple[int, list[str]]]:
    buf: list[str] = []
    start = 0
    quote: str | None = None
    heredoc: str | None = None
    for number, raw in enumerate(text.splitlines(), 1):
        if heredoc is not None:
            if raw.strip() == heredoc:
                heredoc = None
            continue
        if not buf:
            start = number
        part, quote = _scan(raw, quote)
        if quote is None and part.rstrip().endswith("\\") and not part.rstrip().endswith("\\\\"):
            buf.append(part.rstrip()[:-1])
            continue
        buf.append(part)
        if quote is not None:
            continue
        joined = "\n".join(buf) if any("'" in b or '"' in b for b in buf) else " ".join(buf)
        buf = []
        lexer = shlex.shlex(joined, posix=True, punctuation_chars=True)
        lexer.whitespace_split, lexer.commenters = True, ""
        try:
            tokens = list(lexer)
        except ValueError as exc:  # Defensive: _scan tracks quotes already
            raise ConfigError(path, [ConfigProblem(f"{path}:{start}", f"cannot be parsed ({exc})",
                                                   "fix the shell quoting")]) from None
        for i, tok in enumerate(tokens[:-1]):
            if tok in ("<<", "<<-"):
                heredoc = tokens[i + 1]
        if tokens:
            yield start, tokens
    if quote is not None:
        raise ConfigError(path, [ConfigProblem(f"{path}:{start}", f"has an unterminated {quote} quote",
                                               "close the quote")])


def _expand(value: str, variables: Mapping[str, str]) -> str:
    return _VAR.sub(lambda m: variables.get(m[1] or m[2], m[0]), value)


def parse_shell(text: str, path: str, env: dict[str, str] | None = None, *, export_all: bool = False) -> list[Launch]:
    """Launches in a shell script; ``env`` (updated in place) holds the exported variables."""
    exported = {} if env is None else env
    shell_vars: dict[str, str] = dict(exported)
    launches: list[Launch] = []
    for line, tokens in _logical_lines(text, path):
        for argv in _commands(tokens):
            prefix: dict[str, str] = {}
            while argv and _ASSIGN.match(argv[0]):
                name, value = _ASSIGN.match(argv[0]).groups()  # type: ignore[union-attr]
                prefix[name] = _expand(value, {**shell_vars, **prefix})
                argv = argv[1:]
            argv = _unwrap(argv, prefix)
            if not argv:  # plain assignments: shell variables (exported in env files)
                shell_vars.update(prefix)
                if export_all:
                    exported.update(prefix)
                continue
            if argv[0] == "export":
                for item in argv[1:]:
                    m = _ASSIGN.match(item)
                    if m:
                        shell_vars[m[1]] = exported[m[1]] = _expand(m[2], shell_vars)
                    elif item in shell_vars:
                        exported[item] = shell_vars[item]
                continue
            if argv[0] == "unset":
                for item in argv[1:]:
                    exported.pop(item, None)
                    shell_vars.pop(item, None)
                continue
            launch = classify(argv, {**exported, **prefix}, Where(path, line))
            launch.prefix_env = prefix
            if launch.kind != OTHER:
                launches.append(launch)
    return launches


def _commands(tokens: list[str]) -> Iterable[list[str]]:
    argv: list[str] = []
    skip = False
    for tok in tokens:
        if skip:
            skip = False
            continue
        if tok in _SEPARATORS:
            if argv:
                yield argv
            argv = []
        elif tok[:1] in "<>" or tok == "&>":
            skip = True  # a redirection and its target
            if argv and argv[-1].isdigit():  # "2>&1": the fd number is not an argument
                argv.pop()
        else:
            argv.append(tok)
    if argv:
        yield argv


def _unwrap(argv: list[str], prefix: dict[str, str]) -> list[str]:
    """Drop nohup/exec/sudo/env wrappers (``env`` assignments go to ``prefix``)."""
    while argv:
        head = os.path.basename(argv[0])
        if head in _WRAPPERS:
            argv = argv[1:]
            while argv and argv[0].startswith("-") and head == "sudo":
                argv = argv[1:]
        elif head == "env":
            argv = argv[1:]
            while argv and (argv[0].startswith("-") or _ASSIGN.match(argv[0])):
                m = _ASSIGN.match(argv[0])
                if m:
                    prefix[m[1]] = m[2]
                argv = argv[1:]
        else:
            return argv
    return argv


#: ``docker run`` options that take a value (the rest are flags)
_DOCKER_VALUE_OPTS = {"-e", "--env", "-v", "--volume", "-p", "--publish", "--name", "--gpus", "--network", "--net",
                      "--ipc", "--shm-size", "--env-file", "-w", "--workdir", "--entrypoint", "--runtime", "--device",
                      "-u", "--user", "--mount", "--cpus", "--memory", "-m", "--label", "-l", "--restart", "--ulimit",
                      "--cap-add", "--security-opt", "--pid", "--hostname", "-h", "--add-host", "--platform"}


def _docker(argv: list[str], env: dict[str, str], where: Where) -> Launch | None:
    """A ``docker|podman run ... IMAGE ARGS`` of a vLLM image, with the container's ``-e`` environment."""
    container_env: dict[str, str] = {}
    i = 2
    while i < len(argv) and argv[i].startswith("-"):
        opt, eq, value = argv[i].partition("=")
        if not eq and opt in _DOCKER_VALUE_OPTS and i + 1 < len(argv):
            value, i = argv[i + 1], i + 1
        if opt in ("-e", "--env"):
            name, has, val = value.partition("=")
            if has or name in env:
                container_env[name] = val if has else env[name]
        i += 1
    if i >= len(argv) or "vllm" not in argv[i].lower():
        return None
    args = argv[i + 1:]
    if args and (os.path.basename(args[0]) in ("vllm",) or re.fullmatch(r"python[0-9.]*", os.path.basename(args[0]))):
        return classify(args, container_env, where)
    # the vllm/vllm-openai image's entrypoint is the OpenAI API server
    return classify(["python3", "-m", "vllm.entrypoints.openai.api_server", *args], container_env, where)


def classify(argv: list[str], env: dict[str, str], where: Where) -> Launch:
    """Recognise vLLM, proxy, master, holder, metadata and pip commands (also vLLM in ``docker run``)."""
    head = os.path.basename(argv[0])
    rest = argv[1:]
    kind, program = OTHER, head
    if head in ("docker", "podman") and rest[:1] == ["run"]:
        launch = _docker(argv, env, where)
        if launch is not None:
            return launch
    if head == "vllm" and rest[:1] == ["serve"]:
        kind, program, rest = VLLM, "vllm serve", rest[1:]
    elif re.fullmatch(r"python[0-9.]*", head):
        if rest[:1] == ["-m"] and len(rest) > 1:
            module, rest = rest[1], rest[2:]
            if module == "vllm.entrypoints.openai.api_server":
                kind, program = VLLM, "python -m vllm.entrypoints.openai.api_server"
            elif module == "vllm.entrypoints.cli.main" and rest[:1] == ["serve"]:
                kind, program, rest = VLLM, "vllm serve", rest[1:]
            elif module == "pip":
                kind, program = PIP, "pip"
            elif module in ("mooncake.mooncake_store_service",):
                kind, program = HOLDER, module
            elif module == "mooncake.http_metadata_server":
                kind, program = METADATA, module
            elif module in ("mooncake_vllm.cli", "mooncake_vllm"):
                return classify(["mooncake-vllm", *rest], env, where)
        else:
            script = next((a for a in rest if not a.startswith("-")), "")
            if os.path.basename(script) in LEGACY_PROXIES:
                kind, program = PROXY, os.path.basename(script)
                rest = rest[rest.index(script) + 1:]
    elif head == "mooncake-vllm" and rest:
        sub = {"proxy": PROXY, "holder": HOLDER, "up": HOLDER, "demo": HOLDER, "metadata": METADATA}.get(rest[0])
        if sub and not (sub == METADATA and rest[1:2] != ["serve"]):
            kind, program, rest = sub, f"mooncake-vllm {rest[0]}", rest[1:]
    elif head == "mooncake_master":
        kind = MASTER
    elif head in ("mooncake_client", "mooncake_store_service"):
        kind = HOLDER
    elif head in ("mooncake_http_metadata_server", "etcd", "redis-server"):
        kind = METADATA
    elif head in ("pip", "pip3") or (head == "uv" and rest[:1] == ["pip"]):
        kind, program = PIP, "pip"
    launch = Launch(kind, list(argv), dict(env), where, program=program)
    if kind in (VLLM, PROXY):
        positional = _options(rest, launch, _SHORT.get(kind, {}))
        launch.model = launch.options.get("--model") or (positional[0] if positional and kind == VLLM else None)
    else:
        _options(rest, launch, {})
    if kind == VLLM:
        raw = launch.options.get("--kv-transfer-config")
        if raw is not None:
            launch.kv_config_raw = raw
            try:
                launch.kv_config = json.loads(raw)
                if not isinstance(launch.kv_config, dict):
                    launch.kv_config_error = f"{raw[:60]!r} is JSON but not an object"
                    launch.kv_config = None
            except json.JSONDecodeError as exc:
                launch.kv_config_error = f"not valid JSON ({exc.msg} at column {exc.colno})"
    return launch


def _options(rest: list[str], launch: Launch, short: Mapping[str, str]) -> list[str]:
    """Fill ``launch.options`` (``--a b c`` keeps "b c"); return the positional arguments."""
    positional: list[str] = []
    i = 0
    while i < len(rest):
        tok = short.get(rest[i], rest[i])
        if tok.startswith("--"):
            name, eq, value = tok.partition("=")
            name = name.replace("_", "-")
            if not eq:
                values = []
                while i + 1 < len(rest) and not rest[i + 1].startswith("-"):
                    values.append(rest[i + 1])
                    i += 1
                value = " ".join(values)
            launch.options[name] = value
        elif not tok.startswith("-") or tok == "-":
            positional.append(tok)
        i += 1
    return positional
