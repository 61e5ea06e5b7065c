"""A Hugging Face Hub id where a config path is taken (``--hf-config meta-llama/Llama-3.1-8B``, ``owner/name@rev``):
its config.json from the local cache first, downloaded only when the cache lacks it. huggingface_hub reads its own
environment (``HF_HUB_CACHE``, ``HF_HOME``, ``HF_HUB_OFFLINE``, ``HF_TOKEN``); gpuwise reads none of it.

>>> is_hub_id("meta-llama/Llama-3.1-8B"), is_hub_id("config.json"), is_hub_id("Qwen/Qwen3-8B@main")
(True, False, True)
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from gpuwise.errors import GpuwiseError, first_line
from gpuwise.files import file_function

# owner/name as the Hub spells them (huggingface_hub's validate_repo_id: letters, digits, "-", "_", "."; neither
# "--" nor ".." inside; at most 96 characters), then an optional @revision (a branch, a tag or a commit)
_REPO_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[\w./-]+))?")
# names that are files, never repositories: "weights/config.json" that does not exist is a missing file
_FILE_SUFFIXES = (".json", ".safetensors", ".gguf", ".py", ".bin", ".pt", ".pth")


def is_hub_id(text: str) -> bool:
    """Whether ``--hf-config text`` names a Hub repository: not an existing path, and ``owner/name`` (optionally
    ``@revision``) as the Hub spells ids, not ending like a file (``.json``, ``.safetensors``, ``.gguf``...)."""
    match = _REPO_ID.fullmatch(text)
    if match is None or Path(text).exists():
        return False
    repo = match["repo"]
    return len(repo) <= 96 and "--" not in repo and ".." not in repo and not repo.lower().endswith(_FILE_SUFFIXES)


def split_hub_id(text: str) -> tuple[str, str | None]:
    """``owner/name@revision`` -> (``owner/name``, ``revision``); the revision None when not given (the Hub's main)."""
    match = _REPO_ID.fullmatch(text)
    if match is None:
        raise ValueError(f"{text!r} is not a Hub id")  # callers check is_hub_id first
    return match["repo"], match["revision"]


def hub_file(hub_id: str, filename: str = "config.json") -> Path:
    """``filename`` of the Hub repository ``hub_id`` (``owner/name[@revision]``): the cached copy if there is one
    (nothing is asked of the network), else downloaded into the cache. One line for each way it fails: not cached
    and the Hub unreachable (or ``HF_HUB_OFFLINE=1``), gated, not found, no such file or revision."""
    try:
        import huggingface_hub
        from huggingface_hub import errors
    except ImportError:
        raise GpuwiseError(f"--hf-config {hub_id} names a Hugging Face Hub repository, which needs huggingface_hub",
                           "pip install 'gpuwise[hf]', or pass --hf-config path/to/config.json") from None
    repo, revision = split_hub_id(hub_id)
    try:
        return Path(huggingface_hub.hf_hub_download(repo, filename, revision=revision, local_files_only=True))
    except errors.LocalEntryNotFoundError:
        pass  # not in the cache: ask the Hub
    except (errors.HFValidationError, ValueError) as exc:
        raise GpuwiseError(f"--hf-config {hub_id} is not a valid Hub id: {first_line(exc)}",
                           "pass owner/name (optionally @revision), or a path to a config.json") from None
    download = f"hf download {repo} {filename}" + (f" --revision {revision}" if revision else "")
    unreachable = GpuwiseError(f"{repo}'s {filename} is not in the Hugging Face cache and the Hub cannot be reached",
                               f"run `{download}` on a machine online (then copy the cache, ~/.cache/huggingface), "
                               "or pass --hf-config path/to/config.json")
    if not _reachable(huggingface_hub, repo, filename, revision):
        raise unreachable
    try:
        return Path(huggingface_hub.hf_hub_download(repo, filename, revision=revision))
    except errors.GatedRepoError:
        raise GpuwiseError(f"{repo} is a gated repository: its files need an accepted licence and a token",
                           f"accept the terms on https://huggingface.co/{repo}, then log in (`hf auth login`) or "
                           "set HF_TOKEN") from None
    except errors.RepositoryNotFoundError:
        raise GpuwiseError(f"{repo} is neither a local path nor a Hub repository (or it is private)",
                           "check the path or the id, or log in (`hf auth login`, or set HF_TOKEN) if it is "
                           "private") from None
    except errors.RevisionNotFoundError:
        raise GpuwiseError(f"{repo} has no revision {revision!r}", f"pass --hf-config {repo} (its main branch), or "
                           "a branch, tag or commit it has") from None
    except errors.RemoteEntryNotFoundError:
        raise GpuwiseError(f"{repo} has no {filename}", "a repository of GGUF files only: download the .gguf and "
                           "pass --hf-config path/to/model.gguf") from None
    except (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled, OSError):
        raise unreachable from None


def _reachable(huggingface_hub, repo: str, filename: str, revision: str | None) -> bool:
    """Whether one HEAD request for the file gets any answer from the Hub (HF_HUB_OFFLINE=1: no request, False).
    hf_hub_download retries a failed connection five times over ~25 s, logging each; this asks once."""
    url = huggingface_hub.hf_hub_url(repo, filename, revision=revision)
    try:
        huggingface_hub.get_session().head(url, timeout=10)
    except Exception:  # the transport's own errors: requests', httpx's or httpx2's by huggingface_hub's version
        return False
    return True


def hf_config_file(path: str | os.PathLike) -> Path:
    """``--hf-config``: a config.json, a folder holding one (as save_pretrained writes it), a ``.safetensors`` or
    ``.gguf`` checkpoint file, or a Hub id ``owner/name[@revision]`` (its config.json from the Hugging Face cache,
    else downloaded: sources/hub.py)."""
    if is_hub_id(str(path)):
        return hub_file(str(path))
    target = Path(path)
    if target.is_dir():
        target = target / "config.json"
    if not target.is_file():
        raise GpuwiseError(f"no such file: {target}", "pass --hf-config path/to/config.json (or a folder, a .gguf "
                           "file, or a Hub id owner/name)")
    return target


def model_files(model: str | None, hf_config: str | None) -> None:
    """Refuse a missing ``--model file.py:function`` or ``--hf-config`` file (a Hub id's config.json neither cached nor
    reachable) before anything heavy loads."""
    if hf_config is not None and not model:
        hf_config_file(hf_config)
    elif model and (model.endswith(".py") or ".py:" in model):
        file_function(model, "--model")
