"""The per-user cache of embedded LMs: each spec is built once per machine, then loaded from disk.

    cache_dir() -> $KLBENCH_CACHE, else $XDG_CACHE_HOME/klbench, else ~/.cache/klbench
    ensure_embedded_lm(spec, cache_root=None) -> <cache_root>/embedded/<name>-<hash>/, built on first use
    embedded_lm_dir(spec, cache_root=None) -> that folder (it may not exist yet)

The folder is a save_pretrained folder (model, tokenizer, spec.json, pretrain_metrics.json),
so it loads through klbench.models.hf.load_causal_lm like any hub model. Models with one
vocab_size share one tokenizer folder, <cache_root>/embedded/tokenizer-<vocab>-<hash>/.

Only the standard library is imported here at module level: the CLI resolves paths.cache
through cache_dir, and transformers and Lightning are imported only when a build must run.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

from klbench.config.errors import CACHE_WHERE as WHERE
from klbench.config.errors import CacheUnusable, ConfigError, file_above, unusable
from klbench.models.embedded.spec import EMBEDDED_CODE_VERSION, complete_spec, spec_hash, tokenizer_spec

CACHE_ENV = "KLBENCH_CACHE"


# CacheUnusable and unusable() live with the error types (klbench.config.errors): the record's store template
# is made in the same cache and says so with the same line


def check_folder(folder: str | os.PathLike) -> None:
    """At a run's start: the cache is a folder, or can become one (nothing above it is a file). Whether it can
    be written is found when something must be written there: a read-only cache that holds every model a run
    needs serves it."""
    above = file_above(os.fspath(folder))
    if os.path.exists(above) and not os.path.isdir(above):
        raise unusable(os.fspath(folder), "be used", NotADirectoryError(errno.ENOTDIR, "Not a directory", above))


def _disk_full(e: BaseException | None) -> bool:
    """`e` or a cause of it says the disk is full (an OSError, or safetensors' or torch's wording of one)."""
    while e is not None:
        if (isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)) or any(
                w in str(e) for w in ("No space left on device", "StorageFull", "Disk quota exceeded")):
            return True
        e = e.__cause__ or e.__context__
    return False


def cache_dir() -> Path:
    """$KLBENCH_CACHE, else $XDG_CACHE_HOME/klbench, else ~/.cache/klbench (absolute)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser().resolve()
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(xdg):  # the XDG spec: a relative XDG_CACHE_HOME is invalid and ignored
        return Path(xdg, "klbench").resolve()
    return (Path.home() / ".cache" / "klbench").resolve()


@contextlib.contextmanager
def _lock(path: str, final_dir: str):
    """Exclusive advisory lock: racing processes wait here instead of building twice."""
    with open(path, "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"klbench: waiting for another process that is building {final_dir}", file=sys.stderr, flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build_cached(final_dir: str, build, what: str | None = None) -> bool:
    """Run build(tmp_dir) and rename tmp_dir to final_dir unless final_dir exists. True if built here.

    The rename is atomic, so final_dir either does not exist or is complete; the
    lock only saves racing processes from doing the same work twice. `what`, when
    given, names the build in the console line said before it starts, and in the line with the time it took.
    """
    if os.path.isdir(final_dir):
        return False
    parent = os.path.dirname(final_dir)
    with contextlib.ExitStack() as stack:
        try:
            os.makedirs(os.path.join(parent, ".locks"), exist_ok=True)
            stack.enter_context(_lock(os.path.join(parent, ".locks", os.path.basename(final_dir) + ".lock"), final_dir))
        except OSError as e:  # a file where the cache's folder should be, a read-only folder
            raise unusable(os.path.dirname(parent), f"hold {what or os.path.basename(final_dir)}", e) from None
        if os.path.isdir(final_dir):  # another process finished it while we waited
            return False
        prefix = ".tmp-" + os.path.basename(final_dir) + "-"
        for stale in os.listdir(parent):  # left by a killed build; we hold the lock, so nobody is writing them
            if stale.startswith(prefix):
                shutil.rmtree(os.path.join(parent, stale), ignore_errors=True)
        if what:
            print(f"klbench: building {what} (once per machine), cached in {final_dir}", file=sys.stderr, flush=True)
        tmp = tempfile.mkdtemp(prefix=prefix, dir=parent)
        t0 = time.time()
        try:
            build(tmp)
            os.rename(tmp, final_dir)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if _disk_full(e):  # said in one line, with what is left: nothing half-written stays
                free = shutil.disk_usage(parent).free // 1024
                raise CacheUnusable(f"the disk under the klbench cache {os.path.dirname(parent)} ({WHERE}) filled "
                                    f"up while building {what or final_dir}: nothing was kept ({tmp} is removed, "
                                    f"{free} KiB free now). Free space there, or point KLBENCH_CACHE at another "
                                    "disk, and start again") from None
            raise
        if what:
            print(f"klbench: built {what} in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    return True


def _root(cache_root: str | os.PathLike | None) -> str:
    return os.path.join(os.path.abspath(cache_root if cache_root is not None else cache_dir()), "embedded")


def embedded_tokenizer_dir(spec: Mapping, cache_root: str | os.PathLike | None = None) -> str:
    """Where ensure_embedded_tokenizer keeps the tokenizer that `spec`'s model uses."""
    tspec = tokenizer_spec(spec)
    return os.path.join(_root(cache_root), f"tokenizer-{tspec['vocab_size']}-{spec_hash(tspec)}")


def ensure_embedded_tokenizer(spec: Mapping, cache_root: str | os.PathLike | None = None) -> str:
    """Directory with the shared tokenizer for spec's vocab_size, trained on first use."""
    tspec = tokenizer_spec(spec)
    final = embedded_tokenizer_dir(spec, cache_root)

    def build(tmp):
        from klbench.models.embedded.build import train_tokenizer  # transformers only when a build runs
        from klbench.models.embedded.corpus import generate_reviews

        texts = generate_reviews(tspec["corpus_size"], seed=tspec["corpus_seed"],
                                 positive_fraction=tspec["positive_fraction"])
        train_tokenizer(texts, tspec["vocab_size"]).save_pretrained(tmp)
        with open(os.path.join(tmp, "tokenizer_spec.json"), "w") as f:
            json.dump({**tspec, "code_version": EMBEDDED_CODE_VERSION}, f, indent=2, sort_keys=True)

    build_cached(final, build, what=f"the embedded tokenizer ({tspec['vocab_size']} tokens)")
    return final


def embedded_lm_dir(spec: Mapping, cache_root: str | os.PathLike | None = None) -> str:
    """Where ensure_embedded_lm keeps the model for `spec` (it may not exist yet)."""
    spec = complete_spec(spec)
    return os.path.join(_root(cache_root), f"{spec['name']}-{spec_hash(spec)}")


def ensure_embedded_lm(spec: Mapping, cache_root: str | os.PathLike | None = None, progress: bool = True,
                       num_threads: int | None = 1) -> str:
    """Local directory with model + tokenizer for `spec`, pretrained on first use.

    Cached under <cache_root>/embedded/<name>-<hash>/ (cache_root None: cache_dir()),
    hash over the completed spec and EMBEDDED_CODE_VERSION; a different spec gets
    a different directory. num_threads: torch threads while pretraining (see
    klbench.models.embedded.pretrain.pretrain; not part of the spec, since the result
    does not depend on it).
    """
    spec = complete_spec(spec)
    final = embedded_lm_dir(spec, cache_root)
    if os.path.isdir(final):
        if why := damage(final):  # before transformers' 37-line SafetensorError, and its advice meant for a user's folder
            raise CacheUnusable(f"the cached embedded {spec['name']} LM {final} is damaged ({why}): rebuild it with "
                                f"`klbench task=pretrain model.preset={spec['name']} task.force=true` (and the run's "
                                "model.spec options), or delete that folder and the next run builds it again")
        return final
    tok_dir = ensure_embedded_tokenizer(spec, cache_root)

    def build(tmp):
        from transformers import AutoTokenizer

        from klbench.models.embedded.pretrain import pretrain  # Lightning only when a build runs

        t0 = time.time()
        tok = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
        metrics = pretrain(spec, tmp, progress=progress, tokenizer=tok, num_threads=num_threads)
        metrics["build_time_s"] = time.time() - t0
        with open(os.path.join(tmp, "spec.json"), "w") as f:
            json.dump({**spec, "code_version": EMBEDDED_CODE_VERSION}, f, indent=2, sort_keys=True)
        with open(os.path.join(tmp, "pretrain_metrics.json"), "w") as f:
            json.dump(metrics, f, indent=2, sort_keys=True)

    build_cached(final, build, what=f"the embedded {spec['name']} LM")
    return final


def damage(folder: str) -> str | None:
    """What makes a cached model folder unreadable, or None: its JSON files must parse, and each safetensors
    file's header must parse and its tensors' bytes must all be there (a truncated or overwritten file fails
    one or the other). A few reads of small files; the weights themselves are not read."""
    import struct
    for name in ("config.json", "spec.json", "tokenizer.json", "tokenizer_config.json"):
        path = os.path.join(folder, name)
        try:
            with open(path, encoding="utf-8") as f:
                json.load(f)
        except FileNotFoundError:
            return f"{name} is missing"
        except (ValueError, OSError) as e:
            return f"{name} cannot be read: {e}"
    weights = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    if not weights:
        return "it holds no model.safetensors"
    for name in weights:
        path = os.path.join(folder, name)
        try:
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))  # the safetensors header's length, then the header (JSON)
                if n > size - 8:
                    return f"{name}'s header claims {n} bytes, more than the file holds"
                header = json.loads(f.read(n))
            ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"]
        except (struct.error, ValueError, KeyError, TypeError, IndexError, OSError) as e:
            return f"{name} is not a safetensors file ({type(e).__name__})"
        if 8 + n + max(ends, default=0) > size:
            return f"{name} is cut short: {size} bytes of {8 + n + max(ends)}"
    return None
