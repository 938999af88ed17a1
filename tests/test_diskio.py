"""Disk I/O: damaged swap files are errors that name the file and the parameter (never a SIGBUS
or zeros read as data); the O_DIRECT path round-trips any offset and length; the read path is
chosen from facts (forced either way by the option)."""
from __future__ import annotations

import os

import pytest
import torch

import zinf_compile
from zinf_compile.errors import ZinfError
from zinf_compile.runtime import engine as eng_mod
from zinf_compile.runtime.state import STORE

from hf_models import hf_batch, hf_model  # noqa: E402  (tests/ is on the path under pytest)


def _path_of(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


@pytest.fixture(scope="module")
def llama_nvme(offload_root):
    """A small HF Llama whose every large weight is a shard file, after one forward."""
    zinf_compile.reset()
    torch.manual_seed(0)
    model = hf_model("llama").eval()
    batch = hf_batch("llama", batch=1, seq=16)
    opts = {"params": "offload", "offload": "nvme", "offload_dir": os.path.join(offload_root, "diskio")}
    cm = torch.compile(model, backend="zinf", options=opts)
    with torch.no_grad():
        ref = cm(**batch).logits
    yield model, cm, batch, ref
    zinf_compile.reset()


def _entry(model, name):
    p = dict(model.named_parameters())[name]
    e = STORE.entry(p)
    assert STORE.is_managed(p) and e.fd is not None
    return e


@pytest.mark.parametrize("how", ["truncated", "emptied"])
def test_truncated_shard_file_is_an_error_naming_parameter_and_file(llama_nvme, how):
    """A shard file cut short under a running model: the forward raises a ZinfError naming the
    parameter and the file (the mapped gather would otherwise die with SIGBUS); restored, the
    same forward gives the same logits."""
    model, cm, batch, ref = llama_nvme
    name = "model.layers.1.mlp.up_proj.weight"
    e = _entry(model, name)
    path = _path_of(e.fd)
    with open(path, "rb") as f:
        saved = f.read()
    assert len(saved) >= e.shard_nbytes
    os.truncate(path, 0 if how == "emptied" else e.shard_nbytes // 2)
    try:
        with pytest.raises(ZinfError) as info, torch.no_grad():
            cm(**batch)
        msg = str(info.value)
        assert name in msg and path in msg and "truncated" in msg, msg
    finally:
        with open(path, "r+b") as f:
            f.write(saved)
    with torch.no_grad():
        assert torch.equal(cm(**batch).logits, ref)


def test_engine_reads_of_a_truncated_file_name_it(tmp_path):
    e = eng_mod.OffloadEngine(424243, "nvme", str(tmp_path), 2, False)
    try:
        x = torch.randn(1000)
        h = e.offload(x, [0])
        fd = e._stored[e.ticket_of(h)].fd
        os.truncate(_path_of(fd), 100)
        for read in (lambda: e.wait(e.prefetch(h, x.device), x.device, [0]),
                     lambda: e.map_file(fd, 0, 1000, torch.float32),
                     lambda: e.read_file(fd, torch.empty(1000))):
            with pytest.raises(ZinfError, match=r"swap-0\.bin \(an offloaded activation, float32\[1000\]\) "
                                                "holds 100 bytes, 4000"):
                read()
        os.close(fd)  # a file that cannot be read at all
        with pytest.raises(ZinfError, match="cannot be read"):
            e.read_file(fd, torch.empty(10))
        e.swap._fds.clear()
    finally:
        e.close()


def _is_direct(fd: int) -> bool:
    import fcntl

    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)


def test_auto_goes_direct_when_the_files_outgrow_the_page_cache(llama_nvme, offload_root):
    """o_direct="auto" (the default) with facts saying the swap files outgrow the page cache: the
    shard files are opened O_DIRECT, gathers read them into page-aligned buffers (no mapping),
    the plan times reads at the direct bandwidth, and the logits equal the buffered run's."""
    from zinf_compile import backend
    from zinf_compile.cost import BUILTIN

    model0, _, batch, ref = llama_nvme
    torch.manual_seed(0)
    model = hf_model("llama").eval()
    opts = {"params": "offload", "offload": "nvme", "offload_dir": os.path.join(offload_root, "diskio-direct")}
    with pytest.MonkeyPatch.context() as mp:
        facts = []
        real = backend.direct_io

        def tiny_cache(option, nbytes, room):
            facts.append((nbytes, room))
            return real(option, nbytes, nbytes - 1)  # one byte too few
        mp.setattr(backend, "direct_io", tiny_cache)
        cm = torch.compile(model, backend="zinf", options=opts)
        with torch.no_grad():
            out = cm(**batch).logits
    assert facts and facts[0][0] == sum(p.numel() * 4 for p in model.parameters())  # no_grad: no states
    name = "model.layers.1.mlp.up_proj.weight"
    e = _entry(model, name)
    assert e.engine.direct and _is_direct(e.fd) and not e.maps
    assert not _is_direct(_entry(model0, name).fd)  # the first model's files: buffered, mapped
    assert torch.equal(out, ref)
    plan = [p for p in zinf_compile.last_plans() if p.params][-1]
    assert plan.predicted_stall_s >= 0
    assert BUILTIN["cpu"].seen_by(True).nvme_read_bw == BUILTIN["cpu"].nvme_direct_read_bw
    assert BUILTIN["cpu"].seen_by(False) is BUILTIN["cpu"]


def test_direct_io_decision():
    from zinf_compile.planner import direct_io

    assert direct_io(True, 0, 10) and not direct_io(False, 10, 0)
    assert direct_io("auto", 11, 10) and not direct_io("auto", 10, 10)


def test_direct_reads_and_writes_at_any_offset(tmp_path, monkeypatch):
    """O_DIRECT files: whole pages of a page-aligned buffer move without a copy; any other offset
    or length (tiles of a parameter, odd tails) goes through an aligned buffer, keeping the bytes
    around it."""
    e = eng_mod.OffloadEngine(424250, "nvme", str(tmp_path), 4, "auto")
    try:
        assert not e.direct
        assert e.choose_direct(True)
        if not e.direct:
            pytest.fail(f"{tmp_path} refuses O_DIRECT")
        _, fd = e.swap.acquire("probe")
        assert _is_direct(fd)
        assert e.choose_direct(False)  # a file exists: the choice stays
        bounced = []
        real = eng_mod._aligned
        monkeypatch.setattr(eng_mod, "_aligned", lambda n: bounced.append(n) or real(n))
        whole = e.host_empty(3 * (eng_mod.CHUNK_BYTES // 4) + 1024, torch.float32)  # pages, several chunks
        assert whole.data_ptr() % eng_mod.ALIGN == 0
        whole.copy_(torch.randn(whole.numel()))
        e.write_file(fd, whole)
        back = e.host_empty(whole.numel(), torch.float32)
        e.read_file(fd, back)
        assert torch.equal(back, whole) and not bounced
        part = torch.randn(1001)  # at an odd offset, unaligned memory, odd length
        e.write_file(fd, part, offset=4 * 777)
        expect = whole.clone()
        expect[777:777 + 1001] = part
        e.read_file(fd, back)
        assert torch.equal(back, expect) and bounced
        got = torch.empty(1001)
        e.read_file(fd, got, offset=4 * 777)
        assert torch.equal(got, part)
        x = torch.randn(37, 129)
        assert torch.equal(e.wait(e.prefetch(e.offload(x, [1, 0]), x.device), x.device, [1, 0]), x)
    finally:
        e.close()


def test_a_direct_engine_reads_a_buffered_file_in_place(tmp_path, monkeypatch):
    """An O_DIRECT engine reading a file it did not open so (a safetensors checkpoint read in place,
    its tensors 8-byte aligned): plain reads straight into the tensor, at any offset and address,
    never through the page-aligned bounce buffer (a copy of every byte for nothing); what the
    engine writes, it writes direct. And the tensor read into keeps a resizable storage."""
    e = eng_mod.OffloadEngine(424255, "nvme", str(tmp_path / "swap"), 4, "auto")
    try:
        if not e.choose_direct(True):
            pytest.fail(f"{tmp_path} refuses O_DIRECT")
        data = torch.randn(3 * (eng_mod.CHUNK_BYTES // 4) // 2 + 5)
        path = tmp_path / "ckpt.bin"
        path.write_bytes(b"h" * 1248 + data.numpy().tobytes())
        fd = os.open(path, os.O_RDONLY)
        try:
            bounced = []
            real = eng_mod._aligned
            monkeypatch.setattr(eng_mod, "_aligned", lambda n: bounced.append(n) or real(n))
            got = torch.empty(data.numel() + 1)[1:]  # memory off the page, too
            e.read_file(fd, got, offset=1248)
            assert torch.equal(got, data) and not bounced
            assert got.untyped_storage().resizable()
            n, sfd = e.swap.acquire("probe")
            e.write_file(sfd, got)
            assert _is_direct(sfd) and bounced  # unaligned memory into an O_DIRECT file: bounced
            back = e.host_empty(data.numel(), torch.float32)
            e.read_file(sfd, back)
            assert torch.equal(back, data)
            e.swap.release(n)
        finally:
            os.close(fd)
    finally:
        e.close()


def test_calibrate_measures_buffered_and_direct_reads(tmp_path):
    from zinf_compile.calibrate import disk_bandwidths

    bw = disk_bandwidths(str(tmp_path), mib=8)
    assert set(bw) == {"buffered_write", "buffered_read_warm", "buffered_read_cold", "direct_read", "direct_write"}
    assert all(v is not None and v > 1e6 for v in bw.values()), bw
    assert os.listdir(tmp_path) == []


def test_cold_regime_drops_the_page_cache_before_each_timed_step(monkeypatch):
    from bench import _harness

    events = []
    monkeypatch.setattr(_harness, "drop_caches", lambda: events.append("drop") or True)
    monkeypatch.setenv(_harness.COLD_ENV, "1")
    _harness.measure_steps(lambda: events.append("step") or 0.0, warmup=1, steps=2)
    assert events == ["step", "drop", "step", "drop", "step"]
    events.clear()
    monkeypatch.setenv(_harness.COLD_ENV, "0")
    _harness.measure_steps(lambda: events.append("step") or 0.0, warmup=1, steps=2)
    assert events == ["step"] * 3
    monkeypatch.setattr(_harness, "drop_caches", lambda: False)  # not root
    monkeypatch.setenv(_harness.COLD_ENV, "1")
    with pytest.raises(SystemExit, match="needs root"):
        _harness.measure_steps(lambda: 0.0, warmup=0, steps=1)


@pytest.mark.parametrize("direct", [False, True])
def test_checksums_follow_writes_at_any_offset_and_catch_one_flipped_byte(tmp_path, monkeypatch, direct):
    """Random writes (whole blocks, pieces starting or ending inside a block, several chunks,
    concurrent ones: the I/O pool) and reads of random ranges, plain and mapped, against a shadow
    copy: every read returns the bytes written and passes its check. Then one byte of the file is
    flipped: every read of a range in its block raises SwapCorruptionError naming the file and its
    record; reads elsewhere still pass."""
    import random

    from zinf_compile.errors import SwapCorruptionError

    B = eng_mod.BLOCK_BYTES
    e = eng_mod.OffloadEngine(424260 + direct, "nvme", str(tmp_path), 4, "auto")
    try:
        e.choose_direct(direct)
        if direct and not e.direct:
            pytest.fail(f"{tmp_path} refuses O_DIRECT")
        _, fd = e.swap.acquire("probe record")
        rng = random.Random(5)
        size = 2 * eng_mod.CHUNK_BYTES + 3 * B + 1000  # float32 elements: a multiple of 4 bytes
        shadow = torch.zeros(size // 4)
        e.write_file(fd, shadow)
        pieces = [(0, size // 4)] + [(a, rng.randrange(1, 3 * B // 4)) for a in
                                     (rng.randrange(0, size // 4 - 3 * B // 4) for _ in range(40))]
        pieces += [(k * B // 4, B // 4) for k in range(3)] + [(B // 4 - 10, 20), (size // 4 - 7, 7)]
        for a, n in pieces:
            part = torch.randn(n)
            e.write_file(fd, part, offset=4 * a)
            shadow[a:a + n] = part
        # concurrent writes sharing blocks: the pool runs them at once
        sub = [(B // 4 * 5 + 1000 * i, 1000) for i in range(30)]
        futures = []
        parts = [torch.randn(n) for _, n in sub]
        for (a, n), part in zip(sub, parts):
            futures += e._submit_chunks(e._write_chunk, fd, part, 4 * n, 4 * a)
            shadow[a:a + n] = part
        for f in futures:
            f.result()
        # the optimizer's pattern: adjacent 16 KiB chunks inside blocks written at once, into a
        # fresh record (a file just acquired: nothing summed yet) and over the one before; the
        # writes at a block's start slowed down, so the chunks after them finish first
        import time

        real_pwrite = eng_mod._pwrite_all

        def slow_at_block_start(fd_, mv, off_):
            if off_ % B == 0 and fd_ != fd:
                time.sleep(0.02)
            return real_pwrite(fd_, mv, off_)

        monkeypatch.setattr(eng_mod, "_pwrite_all", slow_at_block_start)
        for at in (0, 3000) * 3:  # elements: from a block's start, from inside one
            n2, fd2 = e.swap.acquire("chunks")
            for _ in range(2):
                region = torch.randn(2 * B // 4)
                futures = []
                for c in range(0, region.numel(), 4096):
                    futures += e._submit_chunks(e._write_chunk, fd2, region[c:c + 4096], 4 * 4096, 4 * (at + c))
                for f in futures:
                    f.result()
                got = e.host_empty(region.numel(), torch.float32)
                e.read_file(fd2, got, offset=4 * at)
                assert torch.equal(got, region)
            e.swap.release(n2)
        monkeypatch.undo()

        def ranges():
            r = random.Random(9)
            yield 0, size // 4
            for _ in range(30):
                a = r.randrange(0, size // 4 - 1)
                yield a, r.randrange(1, min(size // 4 - a, 2 * B // 4) + 1)

        for a, n in ranges():
            got = e.host_empty(n, torch.float32)
            e.read_file(fd, got, offset=4 * a)
            assert torch.equal(got, shadow[a:a + n]), (a, n)
            if e.can_map():
                assert torch.equal(e.map_file(fd, 4 * a, n, torch.float32), shadow[a:a + n]), (a, n)
        bad = B + 12345  # a byte of block 1
        with open(_path_of(fd), "r+b") as f:
            f.seek(bad)
            byte = f.read(1)
            f.seek(bad)
            f.write(bytes([byte[0] ^ 0x10]))
        for a, n in ranges():
            touches = 4 * a // B <= 1 <= (4 * (a + n) - 1) // B
            reads = [lambda: e.read_file(fd, e.host_empty(n, torch.float32), offset=4 * a)]
            if e.can_map():
                reads.append(lambda: e.map_file(fd, 4 * a, n, torch.float32))
            for read in reads:
                if touches:
                    with pytest.raises(SwapCorruptionError, match=r"swap-0\.bin \(probe record\) is corrupt: "
                                       rf"bytes \[{B}, {2 * B}\)"):
                        read()
                else:
                    read()
        with pytest.raises(SwapCorruptionError, match="is corrupt"):  # a write merging into the block checks it
            e.write_file(fd, torch.ones(3), offset=B + 8)
        assert e.checksums  # and off, the damage reads through unnoticed (what the checks are for)
        e.checksums = False
        got = torch.empty(size // 4)
        e.read_file(fd, got)
        assert not torch.equal(got, shadow) and (got != shadow).sum() == 1
    finally:
        e.close()


def test_host_buffers_serve_a_read_again_only_once_its_tensor_is_gone():
    """A direct engine's read buffers are recycled (no zero-filled page faults per read), but never
    while any view of the tensor lives; what is kept free stays within its bound."""
    import gc

    pool = eng_mod.HostBuffers(max_free=3 * 4096 * 256, per_size=2)
    a = pool.empty(1000, torch.float32)
    assert a.data_ptr() % eng_mod.ALIGN == 0 and a.numel() == 1000
    a.fill_(7)
    view = a[10:20].view(2, 5)  # a view outlives the tensor object
    ptr = a.data_ptr()
    del a
    gc.collect()
    b = pool.empty(1000, torch.float32)
    assert b.data_ptr() != ptr and bool((view == 7).all())
    del view
    gc.collect()
    c = pool.empty(1000, torch.float32)
    assert c.data_ptr() == ptr and pool.stats["reused"] == 1
    big = [pool.empty(4096 * 256 // 4, torch.float32) for _ in range(4)]  # 1 MiB each
    del big
    gc.collect()
    assert pool._free_bytes <= pool.max_free and len(pool._free[4096 * 256]) == 2


def test_submit_map_checks_in_pieces_and_reports_a_bad_block_through_its_futures(tmp_path, monkeypatch):
    """A mapping is checked in VERIFY_BYTES pieces in the I/O threads: the tensor comes at once,
    a flipped byte in any piece fails its future (and map_file) with the file named."""
    from zinf_compile.errors import SwapCorruptionError

    monkeypatch.setattr(eng_mod, "VERIFY_BYTES", 4 * eng_mod.BLOCK_BYTES)
    e = eng_mod.OffloadEngine(424270, "nvme", str(tmp_path), 3, False)
    try:
        _, fd = e.swap.acquire("mapped record")
        data = torch.randn(5 * eng_mod.VERIFY_BYTES // 4 + 123)
        e.write_file(fd, data)
        t, futures = e.submit_map(fd, 0, data.numel(), torch.float32)
        assert len(futures) == 6
        eng_mod._join(futures)
        assert torch.equal(t, data)
        bad = 4 * eng_mod.VERIFY_BYTES + 100  # in the fifth piece
        with open(_path_of(fd), "r+b") as f:
            f.seek(bad)
            byte = f.read(1)
            f.seek(bad)
            f.write(bytes([byte[0] ^ 1]))
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        _, futures = e.submit_map(fd, 0, data.numel(), torch.float32)
        failed = [f for f in futures if f.exception() is not None]
        assert len(failed) == 1 and isinstance(failed[0].exception(), SwapCorruptionError)
        with pytest.raises(SwapCorruptionError, match=r"swap-0\.bin \(mapped record\) is corrupt"):
            e.map_file(fd, 4 * 1000, data.numel() - 1000, torch.float32)
        e.map_file(fd, 0, 1000, torch.float32)  # elsewhere: fine
    finally:
        e.close()


def _flip(path: str, at: int, keep_mtime: bool = True) -> None:
    """Flip one bit of the file at byte `at`, its mtime set back (what a failing disk leaves)."""
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x04]))
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_source_file_is_checked_per_block_from_its_first_read(tmp_path, monkeypatch):
    """The engine on a file it does not own (watch_source): two tensors sharing a block, the last
    block shorter than BLOCK_BYTES. The first read or mapping of a block records its digest, each
    later one (read, map_file, submit_map's pieces) checks it: a flipped bit with the mtime kept
    is an error naming the file, the parameter read and both holding the block; a changed mtime
    or size is one before any byte is read."""
    from zinf_compile.errors import SwapCorruptionError

    monkeypatch.setattr(eng_mod, "VERIFY_BYTES", 2 * eng_mod.BLOCK_BYTES)
    B = eng_mod.BLOCK_BYTES
    a = torch.randn((B + 1000) // 4)  # bytes [64, B + 1064): ends inside block 1
    b = torch.randn((3 * B) // 4 - 500)  # starts inside block 1, ends inside the last block (3)
    path = str(tmp_path / "weights.bin")
    with open(path, "wb") as f:
        f.write(b"\0" * 64 + a.numpy().tobytes() + b.numpy().tobytes() + b"tail")
    size = os.path.getsize(path)
    a_at, b_at = 64, 64 + a.numel() * 4
    fd = os.open(path, os.O_RDONLY)
    e = eng_mod.OffloadEngine(424271, "nvme", str(tmp_path / "swap"), 3, False)
    try:
        e.watch_source(fd, path, "a", a_at, a.numel() * 4)
        src = e.watch_source(fd, path, "b", b_at, b.numel() * 4)
        out = torch.empty_like(a)
        e.read_file(fd, out, a_at)
        assert torch.equal(out, a) and sorted(src.sums) == [0, 1]  # whole blocks, block 1 shared
        assert torch.equal(e.map_file(fd, b_at, b.numel(), torch.float32), b)
        assert sorted(src.sums) == [0, 1, 2, 3] and src.block(3) == (3 * B, size - 3 * B)
        t, futures = e.submit_map(fd, b_at, b.numel(), torch.float32)  # checked in two pieces
        assert len(futures) == 2
        eng_mod._join(futures)
        assert torch.equal(t, b)
        _flip(path, a_at + a.numel() * 4 - 8)  # a's bytes in block 1, which b shares
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        with pytest.raises(SwapCorruptionError) as info:
            e.read_file(fd, torch.empty_like(b), b_at)
        msg = str(info.value)
        assert (path in msg and "read in place for parameter 'b'" in msg and f"bytes [{B}, {2 * B})" in msg
                and "parameters 'a', 'b'" in msg and "Restore or re-download" in msg), msg
        with pytest.raises(SwapCorruptionError, match="read in place for parameter 'a'"):
            e.map_file(fd, a_at, a.numel(), torch.float32)
        _, futures = e.submit_map(fd, b_at, b.numel(), torch.float32)
        assert [type(f.exception()) for f in futures] == [SwapCorruptionError, type(None)]
        _flip(path, a_at + a.numel() * 4 - 8, keep_mtime=False)  # back, with a new mtime
        with pytest.raises(SwapCorruptionError, match="modified after zinf loaded it"):
            e.map_file(fd, a_at, a.numel(), torch.float32)
        os.utime(path, ns=(os.stat(path).st_atime_ns, src.mtime_ns))
        assert torch.equal(e.map_file(fd, a_at, a.numel(), torch.float32), a)  # as at load again
        os.truncate(path, b_at + 100)
        with pytest.raises(SwapCorruptionError, match=r"holds \d+ bytes, \d+ when zinf loaded it \(truncated\)"):
            e.map_file(fd, b_at, b.numel(), torch.float32)  # never a SIGBUS
    finally:
        e.close()
        os.close(fd)


def test_a_checkpoint_read_in_place_is_checked_at_every_mapped_gather(tmp_path, offload_root):
    """A compiled Llama loaded in place on the CPU (gathers map the safetensors file): a weight's
    bit flipped after the first forward (mtime kept) or its file cut short is a SwapCorruptionError
    naming the file and the weight at the next forward, never data computed with nor a SIGBUS;
    restored, the forward gives the first forward's logits."""
    import transformers as tf

    from zinf_compile.errors import SwapCorruptionError

    zinf_compile.reset()
    ckpt = tmp_path / "ck"
    hf_model("llama", seed=3).save_pretrained(ckpt)
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(hf_model("llama").config)
    opts = {"params": "offload", "offload": "nvme", "offload_dir": os.path.join(offload_root, "inplace-mapped")}
    zinf_compile.load_pretrained(model, ckpt, options=opts, in_place=True)
    cm = torch.compile(model.eval(), backend="zinf", options=opts)
    batch = hf_batch("llama", batch=1, seq=16)
    with torch.no_grad():
        ref = cm(**batch).logits
        assert torch.equal(cm(**batch).logits, ref)
    name = "model.layers.1.mlp.down_proj.weight"
    e = _entry(model, name)
    assert e.source is not None and e.maps
    path = e.source
    with open(path, "rb") as f:
        saved = f.read()
    st = os.stat(path)
    try:
        for damage in ("flipped", "truncated"):
            if damage == "flipped":
                _flip(path, e.base + e.shard_nbytes // 3)
            else:
                os.truncate(path, e.base + e.shard_nbytes // 2)
            with pytest.raises(SwapCorruptionError) as info, torch.no_grad():
                cm(**batch)
            msg = str(info.value)
            assert path in msg and "parameter '" in msg, msg
            assert (name in msg and "differ" in msg) if damage == "flipped" else "truncated" in msg, msg
            with open(path, "r+b") as f:
                f.write(saved)
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
            with torch.no_grad():
                assert torch.equal(cm(**batch).logits, ref)
    finally:
        with open(path, "r+b") as f:
            f.write(saved)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        zinf_compile.reset()
