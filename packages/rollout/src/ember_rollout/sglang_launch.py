"""Launched SGLang servers: their command lines, processes, logs and health."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp

from ember_rollout import sglang_cpu
from ember_rollout.config import gpu_placement_flags
from ember_rollout.engine import EngineError, ModelInfo
from ember_rollout.families import EXPERT_COUNT_KEYS, config_moe_layers

if TYPE_CHECKING:
    from ember_core.quant import QuantSpec
    from ember_rollout.config import SGLangEngineConfig

logger = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_is_free(host: str, port: int) -> bool:
    """Whether `port` can be bound on `host` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


ORIGINAL_LOGPROB_ENV = "SGLANG_RETURN_ORIGINAL_LOGPROB"
"""sglang 0.5.23 `srt/layers/sampler.py` reads this once at import: when true ("1" or "true",
any case) the server returns log softmax(logits) taken before the temperature instead of the
tempered log-probs the trainer computes."""


def check_server_env(env: Mapping[str, str]) -> None:
    """Refuse to launch SGLang servers whose log-probs would be untempered.

    Raises:
        ValueError: One line naming the variable when `ORIGINAL_LOGPROB_ENV` is true in `env`.
    """
    value = env.get(ORIGINAL_LOGPROB_ENV, "")
    if value.strip().lower() in ("1", "true"):
        raise ValueError(
            f"{ORIGINAL_LOGPROB_ENV}={value}: SGLang would return log-probs taken before the "
            "temperature, while rollout log-probs mean log softmax(logits / temperature); "
            f"unset {ORIGINAL_LOGPROB_ENV}"
        )


def model_info_from_dir(path: str | Path | None) -> ModelInfo | None:
    """Layers, top-k, vocabulary and context length from a local HF model's config.json.

    EOS ids come from config.json and generation_config.json together, as transformers
    merges them. Returns None when `path` holds no config.json (an attached server's model).

    Raises:
        ValueError: A field the engine needs is missing or not an integer; names the field and
            the file.
    """
    if path is None or not (Path(path) / "config.json").is_file():
        return None
    file = Path(path) / "config.json"
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{file}: not valid JSON ({exc})") from None
    config = config.get("text_config", config)

    def required(*keys: str) -> int:
        for key in keys:
            value = config.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                return value
        found = {k: config[k] for k in keys if k in config}
        raise ValueError(
            f"{file}: {' or '.join(keys)} is {'missing' if not found else found}; the sglang "
            "engine needs it as a non-negative integer (it does not guess a default)"
        )

    num_layers = required("num_hidden_layers")
    topk = int(config.get("num_experts_per_tok") or 0)
    num_experts = required(*EXPERT_COUNT_KEYS) if topk else 0
    eos: set[int] = set()
    sources = [config]
    generation = Path(path) / "generation_config.json"
    if generation.is_file():
        sources.append(json.loads(generation.read_text()))
    for source in sources:
        value = source.get("eos_token_id")
        eos.update([value] if isinstance(value, int) else value or [])
    return ModelInfo(
        num_layers=num_layers,
        topk=topk,
        num_experts=num_experts,
        moe_layers=config_moe_layers(config),
        vocab_size=required("vocab_size"),
        context_len=required("max_position_embeddings"),
        eos_token_ids=tuple(sorted(eos)),
    )


def resolve_device(device: str) -> str:
    """`sglang.device` with auto resolved: cuda when this process sees a GPU, else cpu."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


FP32_ATTENTION_BACKENDS = ("triton", "torch_native")
"""sglang 0.5.23 attention backends that compute in float32. Its default choice ignores the
dtype (arg_groups/model_override_base.py `get_default_attn_backend`: fa3 on Hopper, trtllm_mha
on SM100, flashinfer elsewhere), and those kernels take fp16 and bf16 only: a float32 server
would not start."""
ATTENTION_BACKEND_FLAGS = (
    "--attention-backend",
    "--prefill-attention-backend",
    "--decode-attention-backend",
)
TRITON_FP32_ENV = "TRITON_F32_DEFAULT"
"""triton 3.8 language/core.py `dot` multiplies float32 in TF32 (10-bit mantissas) where the
GPU has it unless this says otherwise, and sglang's triton attention kernels set no precision
of their own: float32 servers get "ieee"."""


def _flag_values(args: list[str], flag: str) -> list[str]:
    """The values `args` give `flag` (`--flag value` or `--flag=value`)."""
    found = []
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            found.append(args[i + 1])
        elif arg.startswith(flag + "="):
            found.append(arg.split("=", 1)[1])
    return found


def fp32_attention_args(args: list[str]) -> list[str]:
    """`args` of a float32 server on GPUs, with `--attention-backend triton` unless they name
    an fp32 backend (`FP32_ATTENTION_BACKENDS`) themselves.

    Raises:
        ValueError: They name an attention backend that cannot run float32; one line.
    """
    for flag in ATTENTION_BACKEND_FLAGS:
        for backend in _flag_values(args, flag):
            if backend not in FP32_ATTENTION_BACKENDS:
                raise ValueError(
                    f"engine.sglang.dtype=float32 with {flag} {backend}: that attention backend "
                    f"takes fp16 and bf16 only; use one of {', '.join(FP32_ATTENTION_BACKENDS)} "
                    "(or leave it out: Ember launches float32 servers with triton)"
                )
    if _flag_values(args, "--attention-backend"):
        return args
    return [*args, "--attention-backend", FP32_ATTENTION_BACKENDS[0]]


def gpu_server_env(config: SGLangEngineConfig) -> dict[str, str] | None:
    """The environment of launched servers on GPUs: this process's, with `TRITON_FP32_ENV`
    "ieee" for float32 servers; None (this process's as it is) for the others.

    Raises:
        ValueError: `TRITON_FP32_ENV` asks for another float32 precision; one line.
    """
    if config.dtype != "float32":
        return None
    value = os.environ.get(TRITON_FP32_ENV, "ieee")
    if value != "ieee":
        raise ValueError(
            f"{TRITON_FP32_ENV}={value}: engine.sglang.dtype=float32 servers multiply in IEEE "
            f"float32 ({TRITON_FP32_ENV}=ieee); unset it"
        )
    return {**os.environ, TRITON_FP32_ENV: "ieee"}


NO_RADIX_CACHE = "--disable-radix-cache"
"""The server flag that turns off the prefix (radix) cache, which partial rollouts need."""

PORT_RETRIES = 2
"""How many times a launched server whose port was taken before it could bind is launched
again on another port."""


def _log_tail(log_path: Path | None) -> str | None:
    """The last 64 kB of a server log (None when there is no log file)."""
    if log_path is None or not log_path.is_file():
        return None
    with open(log_path, "rb") as file:
        file.seek(max(file.seek(0, os.SEEK_END) - 64_000, 0))
        return file.read().decode(errors="replace")


def port_taken(log_path: Path) -> bool:
    """Whether a server's log says it could not bind its port (uvicorn: "[Errno 98] error
    while attempting to bind on address ...: address already in use")."""
    return "address already in use" in (_log_tail(log_path) or "").lower()


def last_error_line(log_path: Path | None) -> str | None:
    """The last line of a server log that names an error, else its last non-empty line."""
    tail = _log_tail(log_path)
    if tail is None:
        return None
    lines = [ln.strip() for ln in tail.splitlines()]
    lines = [ln for ln in lines if ln]
    for line in reversed(lines):
        if "error" in line.lower() or "exception" in line.lower():
            return line[:300]
    return lines[-1][:300] if lines else None


@dataclass(slots=True)
class LaunchedServer:
    """One server process this engine started, and where its output goes."""

    process: subprocess.Popen
    url: str
    log_path: Path


ENDED_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit('the process that launched this server is gone')\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)
"""Run before a launched server's own command: Linux then sends the server SIGKILL when the
process that launched it dies, so a killed engine actor (a hung one too) leaves no server
behind; sglang 0.5.23's workers (scheduler, detokenizer) SIGKILL themselves when the server
dies (utils/common.py `kill_itself_when_parent_died`). SIGKILL, not SIGTERM: on SIGTERM the
server drains its requests first, 5-20 s or more that its GPU memory stays taken while the
engine's replacement starts on the same GPU and sizes its KV cache from what is free. The
setting survives the exec."""

SERVERS_DIR = Path(tempfile.gettempdir()) / f"ember-sglang-servers-{os.getuid()}"
"""One file per server launched on this machine and not stopped yet, named by its process
group (its pid): the pid of the engine process that launched it, when that process started,
and when the server started (`_reap_orphans`)."""

ORPHAN_WAIT_S = 60.0
"""How long a launch waits for the processes of a dead engine's server to exit."""


def _stat(pid: int | str) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command (state, ppid, pgrp, ...), or None
    when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _started(pid: int) -> str | None:
    """When `pid` started (clock ticks since boot), or None when it does not run: with the
    pid, what names one process even after pids are reused."""
    fields = _stat(pid)
    return None if fields is None or fields[0] == "Z" else fields[19]


def _group_alive(pgid: int) -> bool:
    """Whether a process of group `pgid` still runs (zombies have freed their memory)."""
    for entry in os.scandir("/proc"):
        fields = _stat(entry.name) if entry.name.isdigit() else None
        if fields is not None and int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def _reap_orphans() -> None:
    """Wait until no server launched on this machine by an engine process that has died is
    left, SIGKILLing each one's process group: a replacement engine starts on its
    predecessor's GPUs, and sglang sizes the KV cache from the memory free when it starts.
    Linux only (elsewhere nothing is recorded)."""
    if sys.platform != "linux" or not SERVERS_DIR.is_dir():
        return
    orphans = []
    for file in SERVERS_DIR.iterdir():
        try:
            pgid = int(file.name)
            launcher, launcher_start, server_start = file.read_text().split()
        except OSError:
            continue
        except ValueError:  # not a record
            file.unlink(missing_ok=True)
            continue
        if _started(int(launcher)) == launcher_start:
            continue  # a live engine's server
        leader = _started(pgid)
        if leader is not None and leader != server_start:
            file.unlink(missing_ok=True)  # the pid names another process now
            continue
        # The group's id stays reserved while any process of it runs: it is still the server's.
        orphans.append((pgid, file))
    for pgid, _ in orphans:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
    deadline = time.monotonic() + ORPHAN_WAIT_S
    for pgid, file in orphans:
        while _group_alive(pgid):
            if time.monotonic() >= deadline:
                raise EngineError(
                    f"the SGLang server of an engine that died (process group {pgid}) did "
                    f"not exit within {ORPHAN_WAIT_S:g} s of SIGKILL; its GPU memory is "
                    "still taken"
                )
            time.sleep(0.1)
        file.unlink(missing_ok=True)
        logger.info("the SGLang server of a dead engine (process group %d) is gone", pgid)


def _ended_with_parent(command: list[str]) -> list[str]:
    """`command`, started through `ENDED_WITH_PARENT` on Linux (as it is elsewhere)."""
    if sys.platform != "linux":
        return command
    return [sys.executable, "-c", ENDED_WITH_PARENT, str(os.getpid()), *command]


class ServerLauncher:
    """The part of `SGLangEngine` that launches servers, watches them come up and stops them.

    Server output always goes to a log file (`sglang.log_dir`, or a fresh temporary directory),
    so that a server that fails to start can be named with the line that says why.
    """

    config: SGLangEngineConfig
    extra_server_args: list[str]
    urls: list[str]
    _servers: list[LaunchedServer]
    _http: aiohttp.ClientSession | None
    _port_retries: dict[int, int]
    """Per launched server index, how often it was launched again for a taken port."""
    _launch_context: tuple[Path, dict[str, str] | None]
    """The log directory and environment of the servers (set by `_launch`)."""
    _released: frozenset[str]
    """Memory tags released on every server (`SGLangEngine.release_memory`)."""
    partial_rollouts: bool
    """Whether weights arrive while requests run (`WeightUpdates`): servers then run without
    the radix cache."""
    quantization: QuantSpec | None = None
    """The scheme the servers serve (`engine.quantization`): they launch from a checkpoint of
    it, named by `--quantization` (`sglang_quant.launch_quantization`)."""

    def server_command(self, port: int, index: int = 0) -> list[str]:
        """The command line of launched server `index` (0-based).

        On GPUs server i runs on GPUs `base_gpu_id + i * tp_size` and the `tp_size - 1` after
        it; on CPU it gets the flags of `sglang_cpu.SERVER_ARGS` that the arguments lack. Under
        partial rollouts it runs without the radix cache (`WeightUpdates`). Under
        `quantization` it names the scheme of its checkpoint (`_quantization_args`).

        Raises:
            ValueError: No model_path, the plugins' arguments set the GPU placement, or a
                quantized run's checkpoint, device or arguments do not fit its scheme.
        """
        cfg = self.config
        if cfg.model_path is None:
            raise ValueError("sglang.model_path is required to launch servers (or set sglang.urls)")
        misplaced = gpu_placement_flags(self.extra_server_args, cfg.num_servers)
        if misplaced:
            raise ValueError(
                f"plugins' rollout_server_args {self.extra_server_args} set "
                + "; ".join(misplaced)
                + ": Ember places launched servers on GPUs itself"
            )
        command = [
            cfg.python or sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            cfg.model_path,
            "--host",
            cfg.host,
            "--port",
            str(port),
            "--tp-size",
            str(cfg.tp_size),
        ]
        if cfg.dtype != "auto":
            command += ["--dtype", cfg.dtype]
        args = list(cfg.server_args) + self.extra_server_args
        if self.quantization is not None:
            command += self._quantization_args(args)
        # On CPU sglang takes the fraction of the machine's memory (its KV cache, unless
        # --max-total-tokens caps it, as the CPU flags do).
        if cfg.mem_fraction_static is not None:
            command += ["--mem-fraction-static", str(cfg.mem_fraction_static)]
        if self.partial_rollouts and NO_RADIX_CACHE not in args:
            args.append(NO_RADIX_CACHE)
        if resolve_device(cfg.device) == "cpu":  # no GPUs to place servers on
            return command + sglang_cpu.server_args(args)
        if cfg.dtype == "float32":
            args = fp32_attention_args(args)
        # sglang 0.5.23 entrypoints/engine.py: TP rank r runs on GPU base_gpu_id + r (step 1)
        command += ["--base-gpu-id", str(cfg.base_gpu_id + index * cfg.tp_size)]
        return command + args

    def _quantization_args(self, args: list[str]) -> list[str]:
        """`--quantization` for servers of `self.quantization`, unless `args` name it.

        Raises:
            ValueError: Servers on CPU, a checkpoint of another scheme, or `args` naming
                another method; one line.
        """
        from ember_rollout import sglang_quant

        spec, cfg = self.quantization, self.config
        assert spec is not None and cfg.model_path is not None
        device = resolve_device(cfg.device)
        sglang_quant.check_device(spec, device, f"engine.sglang.device={cfg.device}")
        method = sglang_quant.launch_quantization(cfg.model_path, spec)
        given = _flag_values(args, "--quantization")
        if any(value != method for value in given):
            raise ValueError(
                f"engine.sglang.server_args --quantization {given[0]}: the run serves "
                f"engine.quantization={spec.scheme}, which SGLang loads as {method}"
            )
        return [] if given else ["--quantization", method]

    def _port(self, index: int) -> int:
        """Server `index`'s port: `base_port + index` if set and free, else any free one."""
        cfg = self.config
        if cfg.base_port:
            port = cfg.base_port + index
            if port_is_free(cfg.host, port):
                return port
            chosen = free_port(cfg.host)
            logger.warning(
                "sglang.base_port: port %d (server %d) is in use; launching on %d instead",
                port,
                index,
                chosen,
            )
            return chosen
        return free_port(cfg.host)

    def launch(self) -> None:
        """Launch the servers now, without waiting for them (`start` waits)."""
        if not self.urls:
            self._launch()

    def _launch(self) -> None:
        cfg = self.config
        on_cpu = resolve_device(cfg.device) == "cpu"
        if on_cpu and cfg.python is None and not sglang_cpu.sglang_installed():
            raise EngineError(
                f"engine.kind=sglang launches SGLang servers, but sglang is not installed in "
                f"{sys.executable}'s environment: {sglang_cpu.EXTRA_HINT}"
            )
        _reap_orphans()  # a replacement's predecessor frees its memory first
        log_dir = Path(cfg.log_dir or tempfile.mkdtemp(prefix="ember-sglang-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        env = sglang_cpu.server_env() if on_cpu else gpu_server_env(cfg)
        check_server_env(os.environ if env is None else env)
        self._launch_context = (log_dir, env)
        self._port_retries = {}
        for i in range(cfg.num_servers):
            server = self._start_server(i, self._port(i))
            self._servers.append(server)
            self.urls.append(server.url)

    def _start_server(self, index: int, port: int) -> LaunchedServer:
        log_dir, env = self._launch_context
        command = self.server_command(port, index)
        log_path = log_dir / f"sglang-{index}-{port}.log"
        logger.info("launching SGLang server %d (log %s): %s", index, log_path, " ".join(command))
        with open(log_path, "wb") as sink:
            process = subprocess.Popen(
                _ended_with_parent(command),
                stdout=sink,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        if sys.platform == "linux":  # the process group is the server's pid (new session)
            SERVERS_DIR.mkdir(parents=True, exist_ok=True)
            me, pid = os.getpid(), process.pid
            (SERVERS_DIR / str(pid)).write_text(f"{me} {_started(me)} {_started(pid)}")
        host = "127.0.0.1" if self.config.host in ("0.0.0.0", "::") else self.config.host
        return LaunchedServer(process, f"http://{host}:{port}", log_path)

    def _relaunch_if_port_taken(self, server: LaunchedServer) -> LaunchedServer | None:
        """Launch an exited server again on a fresh port when its log says another process
        took its port: sglang binds its HTTP port only after loading the model and the
        tokenizer, tens of seconds after Ember chose the port, and on a busy machine a Ray
        worker or another server can take it in between. Returns the new server, or None when
        the exit had another cause or the server was relaunched `PORT_RETRIES` times already."""
        index = self._servers.index(server)
        retries = self._port_retries.get(index, 0)
        if retries >= PORT_RETRIES or not port_taken(server.log_path):
            return None
        self._port_retries[index] = retries + 1
        port = free_port(self.config.host)
        logger.warning(
            "SGLang server %d could not bind %s (address already in use); launching it again "
            "on port %d",
            index,
            server.url,
            port,
        )
        (SERVERS_DIR / str(server.process.pid)).unlink(missing_ok=True)  # it exited
        relaunched = self._start_server(index, port)
        self._servers[index] = relaunched
        self.urls[self.urls.index(server.url)] = relaunched.url
        return relaunched

    async def wait_healthy(self, timeout_s: float) -> None:
        """Poll GET /health of every server until all answer 200.

        Raises:
            EngineError: A launched server exited, or `timeout_s` passed; one line naming the
                server, the reason its log gives and the log file.
        """
        launched = {server.url: server for server in self._servers}
        deadline = time.monotonic() + timeout_s
        pending = list(self.urls)
        while pending:
            for url in list(pending):
                server = launched.get(url)
                if server is not None and server.process.poll() is not None:
                    relaunched = self._relaunch_if_port_taken(server)
                    if relaunched is not None:
                        launched[relaunched.url] = relaunched
                        pending[pending.index(url)] = relaunched.url
                        continue
                    reason = last_error_line(server.log_path) or "no output"
                    raise EngineError(
                        f"SGLang server {url} exited with code {server.process.returncode} "
                        f"before becoming healthy: {reason} (log: {server.log_path})"
                    )
                if await self._healthy(url):
                    pending.remove(url)
            if not pending:
                return
            if time.monotonic() >= deadline:
                logs = [str(launched[u].log_path) for u in pending if u in launched]
                where = f" (log: {', '.join(logs)})" if logs else ""
                raise EngineError(
                    f"SGLang servers not healthy after {timeout_s:g}s "
                    f"(engine.sglang.launch_timeout_s): {', '.join(pending)}{where}"
                )
            await asyncio.sleep(min(self.config.health_poll_s, max(deadline - time.monotonic(), 0)))

    async def _healthy(self, url: str) -> bool:
        assert self._http is not None
        try:
            timeout = aiohttp.ClientTimeout(total=max(self.config.health_poll_s, 1.0))
            async with self._http.get(f"{url}/health", timeout=timeout) as response:
                return response.status == 200
        except (TimeoutError, aiohttp.ClientError, OSError):
            return False

    async def check_no_radix_cache(self) -> None:
        """Under partial rollouts, refuse servers that keep the radix cache.

        Weights change while requests run and the cache cannot be flushed then, so a prefix
        cached under older weights would be reused by later requests, their prompts' KV computed
        by other weights than their tokens' (`WeightUpdates`). GET /server_info reports the
        server's resolved arguments (sglang 0.5.23 utils/common.py `build_server_info`).

        Raises:
            EngineError: A server keeps its radix cache or does not say; names it.
        """
        if not self.partial_rollouts:
            return
        assert self._http is not None
        for url in self.urls:
            try:
                async with self._http.get(f"{url}/server_info") as response:
                    info = await response.json(content_type=None) if response.ok else None
            except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
                info = None
            known = isinstance(info, dict) and "disable_radix_cache" in info
            if not known or info["disable_radix_cache"] is not True:
                said = (
                    f"reports disable_radix_cache={info['disable_radix_cache']!r}"
                    if known
                    else "does not report disable_radix_cache"
                )
                raise EngineError(
                    f"rollout.partial_rollouts=true: the SGLang server {url} {said} in GET "
                    f"/server_info; a server that takes weights mid-request must run with "
                    f"{NO_RADIX_CACHE}, or later requests reuse prefixes cached under older "
                    "weights (launch it so, or let Ember launch it)"
                )

    def probe(self, timeout_s: float) -> str | None:
        """Why a server cannot serve (a launched one exited, or one did not answer GET /health
        with 200 within `timeout_s`), or None. Synchronous, without the client's HTTP session,
        so a health probe runs on any thread while requests are in flight; the servers are
        asked at once, so a probe takes `timeout_s` at most however many there are.

        sglang 0.5.23's GET /health is a one-token generate (http_server.py `health_generate`,
        SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION on by default) that waits up to
        SGLANG_HEALTH_CHECK_TIMEOUT (20 s) for the scheduler. While memory is released (the
        colocated hand-off) that generate would write into unmapped KV memory and kill the
        scheduler: then only the launched processes are checked (an attached server, not at
        all)."""
        import urllib.error
        import urllib.request
        from concurrent.futures import ThreadPoolExecutor

        for server in self._servers:
            code = server.process.poll()
            if code is not None:
                log = server.log_path
                return f"SGLang server {server.url} exited with code {code} (log: {log})"
        if self._released or not self.urls:
            return None

        def ask(url: str) -> str | None:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=timeout_s) as response:
                    if response.status == 200:
                        return None
                    said = f"HTTP {response.status}"
            except urllib.error.HTTPError as exc:
                said = f"HTTP {exc.code}"
            except (OSError, ValueError) as exc:  # refused, reset, timed out
                said = str(getattr(exc, "reason", exc))
            return f"SGLang server {url} failed GET /health: {said}"

        with ThreadPoolExecutor(len(self.urls), thread_name_prefix="sglang-probe") as pool:
            answers = list(pool.map(ask, self.urls))
        return next((a for a in answers if a is not None), None)

    async def health(self) -> bool:
        """Whether every server answers GET /health (while memory is released, whether every
        launched process runs: see `probe`)."""
        if self._http is None:
            return False
        if self._released:
            return all(server.process.poll() is None for server in self._servers)
        results = await asyncio.gather(*(self._healthy(url) for url in self.urls))
        return all(results)

    async def _stop_servers(self) -> None:
        """SIGTERM every launched server's process group (the server drains); SIGKILL what is
        left after 30 s."""
        servers, self._servers = self._servers, []
        for server in servers:
            if server.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(server.process.pid, signal.SIGTERM)
        for server in servers:
            try:
                await asyncio.to_thread(server.process.wait, 30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(server.process.pid, signal.SIGKILL)
                await asyncio.to_thread(server.process.wait)
            (SERVERS_DIR / str(server.process.pid)).unlink(missing_ok=True)
        if servers:
            self.urls = [u.rstrip("/") for u in self.config.urls]
