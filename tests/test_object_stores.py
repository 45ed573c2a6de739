"""Sources in object stores: S3 (moto's server), GCS (gcp-storage-emulator) and Azure Blob (Azurite).

Every server is real and listens on loopback (``tests/stores.py``). For each store, the recipe of the
other tests, read from the store, gives the global batches that it gives from local disk, at world sizes
1, 4 and 16 and across resumes (including a checkpoint written reading from disk, resumed reading from
the store). A TCP proxy breaks connections mid-response to show that retries change nothing; the retry
layer itself is also driven by an in-memory filesystem that fails on schedule. Permanent errors and bad
files stop with a message naming the URL. Parquet is read by byte ranges, and the node-local cache is
shared, bounded and invisible in the output.
"""

from __future__ import annotations

import errno
import gzip
import io
import json
import multiprocessing
import pickle
import random
import threading
import time
from pathlib import Path

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from zephon import RecipeError, SourceError, build_loader, global_digest, merge_states, recipe_from_dict, storage
from zephon.readers.parquet import ParquetReader
from zephon.specs import SourceSpec, StorageSpec
from zephon.plan import WorkPlan

from .conftest import base_recipe_dict
from .test_errors import first_error
from .stores import STARTERS, FaultProxy, Store, azurite_connection_string

STEPS = 6
RESUME_AT = 3
FAST_RETRY = {"retries": 4, "retry_backoff_s": 0.001}
STORES = ["s3", "gcs", "azure"]


# -- fixtures and helpers ----------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def servers(tmp_path_factory, corpus):
    """``servers(name) -> Store``: starts a store's server on first use (and uploads the test corpus)."""
    started: dict[str, tuple] = {}
    tmp = tmp_path_factory.mktemp("stores")

    def get(name: str) -> Store:
        if name not in started:
            server, store = STARTERS[name](tmp)
            started[name] = (server, store)
            store.upload_dir(corpus / "web", "corpus/web")
            store.upload_dir(corpus / "code", "corpus/code")
        return started[name][1]

    yield get
    for server, _ in started.values():
        server.stop()


def recipe_dict(corpus, sp_model, store: Store | None = None, prefix: str = "corpus", **top) -> dict:
    """The shared test recipe, reading from ``store`` (None: local disk)."""
    data = base_recipe_dict(corpus, {"kind": "sentencepiece", "path": str(sp_model)})
    if store is not None:
        web, code = data["sources"]
        web["path"] = store.url(f"{prefix}/web")
        code["path"] = store.url(f"{prefix}/code/*.jsonl")
        for s in data["sources"]:
            s["storage_options"] = dict(store.storage_options)
        data["storage"] = dict(FAST_RETRY)
    for key, value in top.items():
        if key == "storage_options":
            for s in data["sources"]:
                s["storage_options"] = value
        else:
            data[key] = value
    return data


def run(recipe, world_size: int, steps: int, state: dict | None = None, **kw) -> tuple[list[str], dict, list]:
    """Global-batch digests of ``steps`` steps on ``world_size`` ranks (from ``state``), the merged state
    after them, and the loaders' metrics."""
    plan = WorkPlan(recipe.to_pipeline()) if kw.get("runner", "thread") == "thread" else None
    loaders = [build_loader(recipe, rank=r, world_size=world_size, plan=plan, **kw) for r in range(world_size)]
    try:
        if state is not None:
            for ld in loaders:
                ld.load_state_dict(state)
        digests = [global_digest([next(ld) for ld in loaders]) for _ in range(steps)]
        return digests, merge_states([ld.state_dict() for ld in loaders]), [ld.metrics() for ld in loaders]
    finally:
        for ld in loaders:
            ld.close()


def content_metrics(m: dict) -> dict:
    """The metrics that count data (not time): equal ones mean nothing was lost or read twice."""
    keys = ("docs", "doc_tokens", "rows_packed", "flushes", "units", "pieces_split", "skipped_records",
            "rows_delivered", "lanes")
    return {k: m[k] for k in keys}


@pytest.fixture(scope="session")
def reference(corpus, sp_model):
    """The local-disk run: digests on 1 rank, its metrics, and a 16-rank checkpoint at RESUME_AT."""
    recipe = recipe_from_dict(recipe_dict(corpus, sp_model))
    digests, _, metrics = run(recipe, 1, STEPS)
    head, state16, _ = run(recipe, 16, RESUME_AT)
    assert head == digests[:RESUME_AT] and len(set(digests)) == STEPS
    return {"digests": digests, "metrics": content_metrics(metrics[0]), "state16": state16,
            "fingerprint": state16["fingerprint"]}




# -- the same batches from every store -----------------------------------------------------------------------

@pytest.mark.e2e
@pytest.mark.parametrize("name", STORES)
def test_store_gives_the_local_batches_at_every_world_size_and_resume(servers, corpus, sp_model, reference, name):
    store = servers(name)
    recipe = recipe_from_dict(recipe_dict(corpus, sp_model, store))
    plan = WorkPlan(recipe.to_pipeline())
    assert all(f.startswith(f"{store.scheme}://") for sp in plan.sources for f in sp.files)
    for w in (1, 4):
        digests, _, _ = run(recipe, w, STEPS)
        assert digests == reference["digests"], f"{name}: world size {w}"
    # 16 ranks, then a checkpoint resumed on 1 rank.
    head, state, _ = run(recipe, 16, RESUME_AT)
    tail, _, _ = run(recipe, 1, STEPS - RESUME_AT, state=state)
    assert head + tail == reference["digests"], f"{name}: 16 ranks, resumed on 1"
    # Same relative file lists, so the store's checkpoints are the local run's (same fingerprint), and a
    # checkpoint written reading from disk on 16 ranks resumes reading from the store on 4.
    assert state["fingerprint"] == reference["fingerprint"]
    tail, _, _ = run(recipe, 4, STEPS - RESUME_AT, state=reference["state16"])
    assert tail == reference["digests"][RESUME_AT:], f"{name}: local 16 -> {name} 4"


@pytest.mark.e2e
@pytest.mark.parametrize("name", STORES)
def test_credentials_and_endpoint_from_the_environment(servers, corpus, sp_model, reference, name, monkeypatch):
    """No storage_options: each client library's standard environment variables point at the store."""
    store = servers(name)
    if name == "s3":
        opts = store.storage_options
        for var, value in {"AWS_ENDPOINT_URL": opts["endpoint_url"], "AWS_ACCESS_KEY_ID": opts["key"],
                           "AWS_SECRET_ACCESS_KEY": opts["secret"], "AWS_DEFAULT_REGION": "us-east-1"}.items():
            monkeypatch.setenv(var, value)
        storage_options = {"skip_instance_cache": True}  # a fresh client, so that it reads the environment
    elif name == "gcs":
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"127.0.0.1:{store.port}")
        storage_options = {"skip_instance_cache": True}
    else:  # ${VAR} references in storage_options are read from the environment too
        monkeypatch.setenv("ZEPHON_TEST_AZURE", azurite_connection_string(store.port))
        storage_options = {"connection_string": "${ZEPHON_TEST_AZURE}"}
    recipe = recipe_from_dict(recipe_dict(corpus, sp_model, store, storage_options=storage_options))
    digests, _, _ = run(recipe, 1, 2)
    assert digests == reference["digests"][:2]


@pytest.mark.e2e
def test_storage_options_stay_out_of_fingerprint_and_repr(corpus, sp_model, servers):
    store = servers("s3")
    a = recipe_from_dict(recipe_dict(corpus, sp_model, store))
    b = recipe_from_dict(recipe_dict(corpus, sp_model, store, storage={"retries": 9, "cache_dir": "/tmp/x"},
                                     storage_options={**store.storage_options, "secret": "another-secret"}))
    assert a.to_pipeline().fingerprint == b.to_pipeline().fingerprint
    assert "testing" not in repr(a) and "another-secret" not in repr(b)
    with pytest.raises(RecipeError, match=r"'storage_options' must be a table"):
        recipe_from_dict(recipe_dict(corpus, sp_model, store, storage_options="endpoint=x"))
    with pytest.raises(RecipeError, match=r"unknown key 'retry' in \[storage\]\. Did you mean 'retries'\?"):
        recipe_from_dict(recipe_dict(corpus, sp_model, store, storage={"retry": 3}))
    with pytest.raises(RecipeError, match=r"storage\.retries' must be an integer >= 0"):
        recipe_from_dict(recipe_dict(corpus, sp_model, store, storage={"retries": -1}))
    with pytest.raises(SourceError, match=r"ZEPHON_UNSET_VAR"):
        WorkPlan(recipe_from_dict(recipe_dict(corpus, sp_model, store, storage_options={"key": "${ZEPHON_UNSET_VAR}"})).to_pipeline())


# -- byte ranges -----------------------------------------------------------------------------------------------

@pytest.mark.e2e
def test_parquet_row_group_is_fetched_by_byte_ranges(servers, corpus_texts):
    """One row group of a 40-row-group file costs the footer and that group's column chunk, not the file."""
    store = servers("s3")
    texts = [t for t in corpus_texts if t][:2000] * 2
    buf = io.BytesIO()
    pq.write_table(pa.table({"id": list(range(len(texts))), "text": texts}), buf, row_group_size=100)
    size = len(buf.getvalue())
    url = store.put_bytes("ranges/big.parquet", buf.getvalue())
    proxy = FaultProxy(store.port)
    try:
        opts = {**store.storage_options, "endpoint_url": f"http://127.0.0.1:{proxy.port}"}
        spec = SourceSpec(name="big", path=(url,), format="parquet", storage_options=opts)
        fs, root = storage.url_to_fs(url, spec, StorageSpec(**FAST_RETRY))
        reader = ParquetReader(fs, "big", "text", chunk_rows=100)
        before = storage.stats()
        starts = reader.row_group_starts(url)  # the footer
        assert len(starts) == 41
        chunk = reader.read(url, int(starts[17]), int(starts[18]))  # one row group
        after = storage.stats()
    finally:
        proxy.close()
    assert chunk.texts == texts[int(starts[17]):int(starts[18])]
    fetched = after["bytes_fetched"] - before["bytes_fetched"]
    assert after["requests"] - before["requests"] <= 3, after
    assert fetched < size / 4, (fetched, size)
    assert proxy.bytes_down < size / 3, (proxy.bytes_down, size)  # all traffic, listing and headers included


# -- transient errors: retried, and the output does not change -----------------------------------------------------

@pytest.mark.e2e
def test_connections_broken_mid_response_change_nothing(servers, corpus, sp_model, reference, monkeypatch):
    """A proxy cuts every 4th request's response (RST or FIN, in headers or body). With the client's own
    retries off, Zephon's retries alone recover: same batches, same counts of documents, units, rows."""
    import s3fs

    store = servers("s3")
    proxy = FaultProxy(store.port)
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)  # s3fs: one attempt
    opts = {**store.storage_options, "endpoint_url": f"http://127.0.0.1:{proxy.port}",
            "config_kwargs": {"retries": {"max_attempts": 1}}, "skip_instance_cache": True}  # botocore: one
    recipe = recipe_from_dict(recipe_dict(corpus, sp_model, store, storage_options=opts,
                                          storage={"retries": 8, "retry_backoff_s": 0.001}))
    try:
        proxy.configure(break_every=4)
        before = storage.stats()
        digests, _, metrics = run(recipe, 1, STEPS)
        tail, _, _ = run(recipe, 16, STEPS - RESUME_AT, state=reference["state16"])  # a resume on 16 ranks
        retries = storage.stats()["retries"] - before["retries"]
    finally:
        proxy.close()
    assert proxy.cuts >= 10 and retries >= proxy.cuts // 2, (proxy.cuts, retries)
    assert digests == reference["digests"]
    assert content_metrics(metrics[0]) == reference["metrics"]
    assert tail == reference["digests"][RESUME_AT:]


class FlakyFS(MemoryFileSystem):
    """An in-memory store that fails on schedule: every ``every``-th data request fails with the next
    fault in ``FAULTS`` (a reset, a timeout, throttling, a 5xx, a cut body, a short read).

    A request's retry right after its own fault is never the one that fails: with worker threads the
    global count is shared, and without this rule one request could land on the schedule on every
    attempt and exhaust its retries by chance (the store would look down, not flaky)."""

    protocol = "flaky"
    store: dict = {}
    pseudo_dirs = [""]
    every = 0
    calls = 0
    faults = 0  # faults injected (each must cost the retry layer one retry)
    just_failed: set = set()
    lock = threading.Lock()

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol("memory://" + path[len("flaky://"):] if path.startswith("flaky://") else path)

    def cat_file(self, path, start=None, end=None, **kwargs):
        data = super().cat_file(path, start=start, end=end, **kwargs)
        key = (path, start, end)
        with FlakyFS.lock:
            FlakyFS.calls += 1
            n = FlakyFS.calls
            due = bool(FlakyFS.every) and n % FlakyFS.every == 0 and key not in FlakyFS.just_failed
            if due:
                FlakyFS.just_failed.add(key)
                FlakyFS.faults += 1
            else:
                FlakyFS.just_failed.discard(key)
        if due:
            fault = FAULTS[(n // FlakyFS.every) % len(FAULTS)]
            if fault == "short":
                return data[: len(data) // 2]  # a body cut short without an error: must not pass
            raise fault()
        return data


def _client_error(code: str, status: int) -> Exception:
    from botocore.exceptions import ClientError

    return ClientError({"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}},
                       "GetObject")


def _s3fs_translated_500() -> Exception:
    from s3fs.errors import translate_boto_error

    return translate_boto_error(_client_error("InternalError", 500))


def _payload_error() -> Exception:
    import aiohttp

    return aiohttp.ClientPayloadError("Response payload is not completed")


def _azure_response_error() -> Exception:
    from azure.core.exceptions import ServiceResponseError

    return ServiceResponseError("Connection aborted")


FAULTS = [lambda: ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"), "short",
          lambda: TimeoutError("read timed out"), lambda: _client_error("SlowDown", 503), _s3fs_translated_500,
          _payload_error, _azure_response_error]


@pytest.fixture
def flaky(corpus):
    fsspec.register_implementation("flaky", FlakyFS, clobber=True)
    fs = FlakyFS()
    for sub in ("web", "code"):
        for f in sorted((corpus / sub).iterdir()):
            fs.pipe_file(f"/corpus/{sub}/{f.name}", f.read_bytes())
    FlakyFS.every, FlakyFS.calls, FlakyFS.faults = 0, 0, 0
    FlakyFS.just_failed.clear()
    yield fs
    FlakyFS.every = 0
    FlakyFS.store.clear()


def test_retry_layer_recovers_every_transient_fault_unchanged(flaky, corpus, sp_model, reference):
    data = recipe_dict(corpus, sp_model)
    data["sources"][0]["path"] = "flaky://corpus/web"
    data["sources"][1]["path"] = "flaky://corpus/code/*.jsonl"
    data["storage"] = dict(FAST_RETRY)
    recipe = recipe_from_dict(data)
    FlakyFS.every = 3
    before = storage.stats()
    digests, _, metrics = run(recipe, 1, STEPS)
    assert digests == reference["digests"]
    assert content_metrics(metrics[0]) == reference["metrics"]
    digests, _, _ = run(recipe, 4, STEPS, num_workers=2)  # concurrent requests from worker threads
    assert digests == reference["digests"]
    assert storage.stats()["retries"] - before["retries"] >= FlakyFS.faults > 10


def test_classification_of_client_errors():
    import aiohttp
    from azure.core.exceptions import ClientAuthenticationError, HttpResponseError, ResourceNotFoundError
    from gcsfs.retry import HttpError

    transient = [ConnectionResetError(), ConnectionRefusedError(), TimeoutError(), OSError(errno.ECONNRESET, "x"),
                 _client_error("SlowDown", 503), _client_error("ThrottlingException", 400), _s3fs_translated_500(),
                 _payload_error(), aiohttp.ServerDisconnectedError(), _azure_response_error(),
                 HttpResponseError(response=None, message="busy"), HttpError({"code": 503, "message": "x"}),
                 HttpError({"code": 429, "message": "x"}), storage._ShortRead("short")]
    transient[10].status_code = 503
    for exc in transient:
        assert storage.classify(exc) == storage.TRANSIENT, repr(exc)
    assert storage.classify(FileNotFoundError("x")) == storage.MISSING
    assert storage.classify(ResourceNotFoundError("x")) == storage.MISSING
    assert storage.classify(_client_error("NoSuchKey", 404)) == storage.MISSING
    assert storage.classify(PermissionError("x")) == storage.DENIED
    assert storage.classify(ClientAuthenticationError("x")) == storage.DENIED
    assert storage.classify(OSError("Forbidden: b/o\nno access")) == storage.DENIED
    assert storage.classify(_client_error("AccessDenied", 403)) == storage.DENIED
    assert storage.classify(ValueError("bad argument")) == storage.PERMANENT
    delays = [storage.backoff_delay(k, 0.5) for k in range(4)]
    assert all(0.25 * 2 ** k <= d < 0.75 * 2 ** k for k, d in enumerate(delays)), delays


@pytest.mark.timeout(60)
def test_retries_are_bounded_and_permanent_errors_are_not_retried():
    calls = []

    def always(exc):
        def fn():
            calls.append(1)
            raise exc
        return fn

    url = "s3://bucket/key.parquet"
    with pytest.raises(SourceError, match=r"source 'web': reading s3://bucket/key\.parquet failed 4 times with "
                                          r"transient errors \(last: ConnectionResetError"):
        storage.call_with_retries(always(ConnectionResetError("reset")), url, "reading", "web", 3, 0.001)
    assert len(calls) == 4
    for exc, pattern in [(PermissionError("denied"), r"access to s3://bucket/key\.parquet was denied"),
                         (FileNotFoundError("gone"), r"s3://bucket/key\.parquet does not exist"),
                         (ValueError("odd"), r"reading s3://bucket/key\.parquet failed \(ValueError: odd\)")]:
        calls.clear()
        with pytest.raises(SourceError, match=pattern):
            storage.call_with_retries(always(exc), url, "reading", "web", 3, 10.0)  # a retry would sleep 10 s
        assert len(calls) == 1


# -- permanent errors and bad files on real stores ------------------------------------------------------------------

@pytest.mark.e2e
@pytest.mark.timeout(60)
def test_object_deleted_after_planning_names_the_url(servers, corpus, sp_model):
    store = servers("s3")
    for sub in ("web", "code"):
        store.upload_dir(corpus / sub, f"gone/{sub}")
    recipe = recipe_from_dict(recipe_dict(corpus, sp_model, store, prefix="gone", lanes=2,
                                          storage={"retries": 3, "retry_backoff_s": 5.0}))
    loader = build_loader(recipe, rank=0, world_size=1)
    for f in store.fs.find(f"{store.bucket}/gone"):
        store.fs.rm(f)
    t0, before = time.monotonic(), storage.stats()["retries"]
    with pytest.raises(SourceError, match=r"s3://zephon/gone/(web|code)/\S+ does not exist") as info:
        for _ in range(20):
            next(loader)
    loader.close()
    assert time.monotonic() - t0 < 5 and storage.stats()["retries"] == before, "a missing object is not retried"
    assert "restore the object" in str(info.value)


@pytest.mark.e2e
@pytest.mark.timeout(60)
def test_access_denied_names_the_url(servers, corpus, sp_model):
    store = servers("azure")
    bad = azurite_connection_string(store.port, key="A" * 86 + "==")
    recipe = recipe_from_dict(recipe_dict(corpus, sp_model, store, storage_options={"connection_string": bad}))
    where, exc = first_error(recipe)
    assert where == "build" and isinstance(exc, SourceError), exc
    assert "access to az://zephon/corpus/web was denied" in str(exc) and "credentials" in str(exc)


@pytest.mark.e2e
@pytest.mark.timeout(60)
def test_unreachable_store_fails_after_bounded_retries(servers, corpus, sp_model, monkeypatch):
    import s3fs

    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)  # only Zephon's retries, for speed
    store = servers("s3")
    proxy = FaultProxy(store.port)
    proxy.configure(refuse=True)
    opts = {**store.storage_options, "endpoint_url": f"http://127.0.0.1:{proxy.port}",
            "config_kwargs": {"retries": {"max_attempts": 1}}, "skip_instance_cache": True}
    recipe = recipe_from_dict(recipe_dict(corpus, sp_model, store, storage_options=opts,
                                          storage={"retries": 2, "retry_backoff_s": 0.01}))
    try:
        where, exc = first_error(recipe)
    finally:
        proxy.close()
    assert where == "build" and isinstance(exc, SourceError), exc
    assert "s3://zephon/corpus/web failed 3 times with transient errors" in str(exc), exc
    assert proxy.connections >= 3


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name,case", [("s3", "truncated-parquet"), ("gcs", "no-text-column"),
                                       ("azure", "truncated-gzip"), ("gcs", "missing-path")])
@pytest.mark.e2e
def test_bad_files_in_a_store_name_the_object(servers, corpus, sp_model, corpus_texts, name, case):
    store = servers(name)
    texts = [t for t in corpus_texts if t][:60]
    if case == "truncated-parquet":
        buf = io.BytesIO()
        pq.write_table(pa.table({"text": texts}), buf, row_group_size=10)
        url = store.put_bytes("bad/trunc/a.parquet", buf.getvalue()[: len(buf.getvalue()) // 2])
        source, expect = {"path": url, "format": "parquet"}, [url, "not a readable Parquet file"]
    elif case == "no-text-column":
        buf = io.BytesIO()
        pq.write_table(pa.table({"body": texts}), buf, row_group_size=10)
        url = store.put_bytes("bad/col/a.parquet", buf.getvalue())
        source, expect = {"path": url, "format": "parquet"}, [url, "no column 'text'", "columns: body"]
    elif case == "truncated-gzip":
        raw = gzip.compress("".join(json.dumps({"text": t}) + "\n" for t in texts).encode())
        url = store.put_bytes("bad/gz/a.jsonl.gz", raw[: len(raw) - 20])
        source, expect = {"path": url, "format": "jsonl"}, [url, "corrupt or truncated"]
    else:
        url = store.url("bad/absent/")
        source, expect = {"path": url, "format": "jsonl"}, [url, "does not exist"]
    data = recipe_dict(corpus, sp_model, store, lanes=2)
    data["sources"] = [{"name": "bad", **source, "storage_options": dict(store.storage_options)}]
    where, exc = first_error(recipe_from_dict(data))
    assert isinstance(exc, SourceError), (where, exc)
    for text in expect:
        assert text in str(exc), str(exc)


# -- the node-local cache ---------------------------------------------------------------------------------------------

def _cache_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file() and not f.name.startswith(".tmp-"))


@pytest.mark.e2e
def test_cache_serves_repeat_reads(servers, corpus, sp_model, reference, tmp_path):
    store = servers("s3")
    cache = {**FAST_RETRY, "cache_dir": str(tmp_path / "cache"), "cache_block_bytes": 16 << 10}
    recipe = recipe_from_dict(recipe_dict(corpus, sp_model, store, storage=cache))
    digests, _, _ = run(recipe, 4, STEPS, num_workers=2)  # cold: worker threads fill the cache at once
    assert digests == reference["digests"]
    assert _cache_bytes(tmp_path / "cache") > 0
    before = storage.stats()
    digests, _, _ = run(recipe, 16, STEPS)  # warm: every byte from the cache
    after = storage.stats()
    assert digests == reference["digests"]
    assert after["cache_hits"] > before["cache_hits"] and after["bytes_fetched"] == before["bytes_fetched"]


@pytest.mark.e2e
def test_cache_is_bounded_and_evicts_least_recently_used(servers, corpus, sp_model, reference, tmp_path):
    store = servers("gcs")
    limit, block = 64 << 10, 8 << 10
    cache = {**FAST_RETRY, "cache_dir": str(tmp_path / "c"), "cache_block_bytes": block, "cache_max_bytes": limit}
    recipe = recipe_from_dict(recipe_dict(corpus, sp_model, store, storage=cache))
    before = storage.stats()
    digests, _, _ = run(recipe, 4, STEPS)
    assert digests == reference["digests"]
    assert storage.stats()["cache_evictions"] > before["cache_evictions"]
    assert _cache_bytes(tmp_path / "c") <= limit + limit // 16 + block


def _hammer_cache(root: str, seed: int, max_bytes: int, out) -> None:
    """One rank of a node: reads and writes the same blocks as the others; reports any torn block."""
    cache = storage.BlockCache(root, max_bytes=max_bytes)
    rng, bad = random.Random(seed), 0
    for _ in range(400):
        b = rng.randrange(8)
        block = bytes([b]) * (20000 + 3000 * b)
        if rng.random() < 0.5:
            cache.put("k" * 40, b, block)
        else:
            got = cache.get("k" * 40, b, len(block))
            bad += got is not None and got != block
    out.put(bad)


def test_block_cache_shared_by_processes_never_shows_a_partial_block(tmp_path):
    """Four processes (as four ranks of one node) share one cache with a limit that forces evictions."""
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_hammer_cache, args=(str(tmp_path), seed, 100_000, out)) for seed in range(4)]
    for p in procs:
        p.start()
    bad = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert bad == [0, 0, 0, 0] and all(p.exitcode == 0 for p in procs)
    assert not list(tmp_path.rglob(".tmp-*"))
    assert _cache_bytes(tmp_path) <= 100_000 + 100_000 // 16 + 41_000 * 4


@pytest.mark.e2e
def test_recipe_with_storage_options_rebuilds_its_plan_in_another_process(servers, corpus, sp_model):
    """Lane worker processes receive the pickled recipe and rebuild the filesystem from it."""
    store = servers("azure")
    recipe = recipe_from_dict(recipe_dict(corpus, sp_model, store))
    clone = pickle.loads(pickle.dumps(recipe))
    assert clone.sources[0].storage_options == store.storage_options and clone.storage == recipe.storage
    assert [sp.files for sp in WorkPlan(clone.to_pipeline()).sources] == [sp.files for sp in WorkPlan(recipe.to_pipeline()).sources]
