"""FP8 storage (issue 18): quantisation, the format, every reader, and the error it costs.

The cache fixtures are real: the embedded tiny Qwen3 through dspark-produce, once as fp8 and
once as bf16 (``small_cache``), the same rows and settings.
"""

from __future__ import annotations

import functools
import json
import re

import msgspec
import numpy as np
import pytest
import torch
import webdataset as wds
from safetensors.torch import save_file

import dspark_cache
from dspark_cache.format.errors import CorruptShardError
from dspark_cache.format.geometry import SampleShape
from dspark_cache.format.paths import CachePaths
from dspark_cache.nemo import nemo_format
from dspark_cache.format.sample import (
    CACHE_DTYPES, FP8_MAX, HIDDEN, HIDDEN_SCALE, LAST_HIDDEN, LAST_HIDDEN_SCALE, dequantize_rows,
    float32_to_bf16_bits, fp8_to_float32, is_fp8,
)
from dspark_cache.format.schema import (
    FORMAT_FP8,
    FORMAT_ID,
    FP8_DTYPES,
    Manifest,
    decode_manifest,
    encode_json,
)
from dspark_cache.format.tar.writer import ShardWriter
from dspark_cache.format.wds import decode_dspark_arrays
from dspark_cache.loader.tensors import decode_dspark_sample
from dspark_cache.loader.validate import CacheMismatchError, check_expectations
from dspark_cache.format.manifest import write_manifest
from dspark_cache.producer.pipeline.tensors import byte_views, quantize_fp8
from tests.support.produce import run_produce

TORCH_FP8 = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
STATES = ("target_hidden_states", "target_last_hidden_states")


@pytest.fixture(scope="session")
def fp8_cache(embedded, tmp_path_factory) -> str:
    """``small_cache``'s rows and settings, stored as fp8."""
    out = str(tmp_path_factory.mktemp("fp8") / "cache")
    assert run_produce(embedded.stock, embedded.data, out, "--seq-length", "512", "--shard-size", "8",
                       "--batch-size", "4", "--dtype", "fp8") == 0
    return out


def _relative_rms(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return float((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt())


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A float tensor's bytes, for bit-for-bit comparisons (NaN- and -0-safe)."""
    return t.contiguous().view(torch.uint8)


# -- the numbers ----------------------------------------------------------------------------------


@pytest.mark.parametrize("code", sorted(TORCH_FP8))
def test_every_fp8_code_decodes_as_torch_does(code):
    codes = np.arange(256, dtype=np.uint8)
    ours = fp8_to_float32(codes, code)
    theirs = torch.from_numpy(codes).view(TORCH_FP8[code]).float().numpy()
    finite = np.isfinite(theirs)  # NaN/inf codes, which the producer never writes, read as finite
    assert finite.sum() >= 248 and np.isfinite(ours).all()
    assert np.array_equal(ours[finite].view(np.uint32), theirs[finite].view(np.uint32))
    values = np.random.default_rng(0).standard_normal(10_000).astype(np.float32) * 3e3
    assert np.array_equal(
        float32_to_bf16_bits(values), torch.from_numpy(values).bfloat16().view(torch.int16).numpy()
    )


@pytest.mark.parametrize("code", sorted(TORCH_FP8))
def test_quantisation_saturates_and_keeps_zero_rows_exact(code):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 3 * 64, generator=g)
    x[0] = 0.0  # a zero row (both layers' groups)
    x[1, :64] = 1e30  # huge, still finite
    x[2, 64:128] = torch.randn(64, generator=g) * 1e-40  # float32 subnormals
    x[3, 5] = -7e4  # one outlier in a group
    q, scales = quantize_fp8(x, 64, code)
    assert q.dtype == TORCH_FP8[code] and scales.shape == (6, 3) and scales.dtype == torch.float32
    assert torch.isfinite(scales).all() and (scales > 0).all()
    back = torch.from_numpy(dequantize_rows(q.view(torch.uint8).numpy(), scales.numpy(), code, "F32"))
    assert torch.isfinite(back).all()
    assert torch.equal(back[0], torch.zeros(3 * 64))
    # Each group's max |x| lands on the format's largest value (but groups so small that their scale
    # sits at its floor, the smallest normal float32); everything else is within half a step.
    floor = scales == torch.finfo(torch.float32).tiny
    assert floor[0].all() and floor[2, 1] and floor.sum() == 4
    top = q.float().abs().unflatten(-1, (3, 64)).amax(-1)
    assert torch.equal(top[~floor], torch.full(((~floor).sum(),), FP8_MAX[code]))
    mantissa = {"F8_E4M3": 3, "F8_E5M2": 2}[code]
    bias = {"F8_E4M3": 7, "F8_E5M2": 15}[code]
    half_step = torch.maximum(x.abs() * 2.0 ** -(mantissa + 1),
                              scales.repeat_interleave(64, -1) * 2.0 ** (-bias - mantissa))
    assert ((back - x).abs() <= half_step * 1.0001).all()


def test_outlier_channels_do_not_cost_the_other_channels_precision():
    """Real activations have a few massive channels: a per-(token, layer) scale then spends the
    range on them. e4m3 keeps ~2.6% relative RMS on the other channels up to ~10^4 x the median
    (BENCHMARKS.md); past that e5m2's wider range wins, which is its case."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(512, 1024, generator=g)
    channels = torch.tensor([3, 511, 1000])
    normal = torch.ones(1024, dtype=torch.bool)
    normal[channels] = False

    def error(ratio: float, code: str) -> float:
        y = x.clone()
        y[:, channels] = ratio * x.abs().median()
        q, s = quantize_fp8(y, 1024, code)
        back = torch.from_numpy(dequantize_rows(q.view(torch.uint8).numpy(), s.numpy(), code, "F32"))
        return _relative_rms(back[:, normal], y[:, normal])

    plain = error(0, "F8_E4M3")
    assert 0.02 < plain < 0.03
    assert error(1e3, "F8_E4M3") < 1.05 * plain and error(1e4, "F8_E4M3") < 1.1 * plain
    assert error(1e5, "F8_E4M3") > 2 * plain  # the range runs out ...
    assert error(1e5, "F8_E5M2") < 0.06  # ... where e5m2's does not


def test_scales_cost_under_one_percent_and_fp8_halves_the_bytes_at_h1024():
    """Exact sample bytes (the writer's and the planner's own arithmetic) for Qwen3-0.6B's width."""
    for layer_ids in ([1, 8, 14, 20, 27], [-1, 5, 9]):  # final state inside the ids, and apart
        fp8, bf16 = SampleShape(layer_ids, 28, 1024, "F8_E4M3"), SampleShape(layer_ids, 28, 1024, "BF16")
        for length in (1, 64, 700, 4096):
            scales = sum(
                spec.nbytes for spec in fp8.specs(length) if spec.name in (HIDDEN_SCALE, LAST_HIDDEN_SCALE)
            )
            assert scales < 0.01 * fp8.data_size(length)
            if length >= 64:
                assert fp8.data_size(length) <= 0.53 * bf16.data_size(length)


# -- the format -----------------------------------------------------------------------------------


def test_fp8_manifests_are_marked_and_checked():
    assert {name for name, code in CACHE_DTYPES.items() if is_fp8(code)} == set(FP8_DTYPES)
    fields = dict(target_model="t", target_model_type="qwen3", target_vocab_size=10, hidden_size=8,
                  num_hidden_layers=2, seq_length=16, num_samples=0, shard_size=1, target_hidden_dim=8,
                  target_last_hidden_dim=8, target_layer_ids=[1], train_data_path="d")
    fp8 = Manifest(dtype="fp8", **fields)
    assert (fp8.format_version, fp8.scale_scheme) == (FORMAT_FP8, "absmax-per-token-layer/F32")
    assert Manifest(dtype="bf16", **fields).format_version == FORMAT_ID  # unchanged: older readers read it
    assert decode_manifest(encode_json(fp8), "m").format_version == FORMAT_FP8
    edited = json.loads(encode_json(fp8))
    edited.update(format_version=FORMAT_ID, scale_scheme="")
    with pytest.raises(msgspec.DecodeError, match="stored as float8.*dspark-wds/3"):
        decode_manifest(json.dumps(edited).encode(), "m")
    edited["format_version"] = "dspark-wds/5"  # /4 is the compressed caches' (issue 42)
    with pytest.raises(msgspec.DecodeError, match="upgrade dspark-cache"):
        decode_manifest(json.dumps(edited).encode(), "m")


def test_fp8_cache_round_trip_close_to_bf16(fp8_cache, small_cache):
    fp8 = dspark_cache.open_cache(fp8_cache)
    bf16 = dspark_cache.open_cache(small_cache)
    assert (fp8.manifest.dtype, fp8.manifest.format_version) == ("fp8", FORMAT_FP8)
    assert fp8.manifest.planned_bytes == sum(s.tar_bytes for s in fp8.shards)  # the plan's exact bytes
    ratio = fp8.manifest.planned_bytes / bf16.manifest.planned_bytes
    assert 0.5 < ratio < 0.56  # H = 64 here: scales are 4 bytes per 64 columns (0.39% at H = 1024)
    layers = len(fp8.manifest.target_layer_ids)
    worst = [0.0] * (layers + 1)
    raw = dspark_cache.open_cache(fp8_cache, dtype="raw")
    for a, b, r in zip(fp8.samples(), bf16.samples(), raw.samples()):
        assert a["sample_id"] == b["sample_id"] == r["sample_id"]
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        assert a["target_hidden_states"].dtype == torch.bfloat16  # dequantised by default
        assert r["target_hidden_states"].dtype == torch.float8_e4m3fn and r[HIDDEN_SCALE].shape[1] == layers
        for k in range(layers):
            cols = slice(k * 64, (k + 1) * 64)
            worst[k] = max(
                worst[k],
                _relative_rms(a["target_hidden_states"][:, cols], b["target_hidden_states"][:, cols]),
            )
        worst[-1] = max(
            worst[-1], _relative_rms(a["target_last_hidden_states"], b["target_last_hidden_states"])
        )
        assert torch.equal(
            _bits(dspark_cache.dequantize(r)["target_hidden_states"]), _bits(a["target_hidden_states"])
        )
    assert max(worst) < 0.04 and min(worst) > 0.005  # per layer; quantisation happened
    fp8.close(), bf16.close(), raw.close()


def test_loader_dequantises_identically_in_c_python_and_torch(fp8_cache, executor):
    def epoch(dtype):
        loader = dspark_cache.build_dataloader(fp8_cache, 4, shuffle=False, dtype=dtype, pin_memory=False,
                                               pad_to="longest", num_workers=1)
        assert loader.reader.native == (executor == "native")
        return [{k: v.clone() for k, v in b.items()} for b in loader]

    default, f32, raw = epoch(None), epoch("fp32"), epoch("raw")
    assert raw[0][HIDDEN].dtype == torch.float8_e4m3fn and raw[0][LAST_HIDDEN_SCALE].shape[-1] == 1
    for a, b, r in zip(default, f32, raw):
        assert (
            HIDDEN_SCALE not in a and a[HIDDEN].dtype == torch.bfloat16 and b[HIDDEN].dtype == torch.float32
        )
        for name in STATES:
            assert torch.equal(_bits(dspark_cache.dequantize(r)[name]), _bits(a[name]))
            assert torch.equal(_bits(dspark_cache.dequantize(r, torch.float32)[name]), _bits(b[name]))
    # The same bytes as open_cache's (numpy) dequantisation, row by row.
    cache = dspark_cache.open_cache(fp8_cache, dtype="fp32")
    by_id = {s["sample_id"]: s for s in cache.samples()}
    for batch in f32:
        for row, sid in enumerate(batch["sample_ids"].tolist()):
            n = by_id[sid]["input_ids"].shape[0]
            for name in STATES:
                assert torch.equal(_bits(batch[name][row, :n]), _bits(by_id[sid][name]))
                assert not batch[name][row, n:].any()


def test_dtype_is_checked_against_the_cache(fp8_cache, small_cache):
    with pytest.raises(ValueError, match="only FP8 caches are converted"):
        dspark_cache.build_dataloader(small_cache, 2, dtype="fp32")
    with pytest.raises(ValueError, match="bf16 or fp32"):
        dspark_cache.build_dataloader(fp8_cache, 2, dtype="fp16")
    manifest = dspark_cache.open_cache(fp8_cache).manifest
    with pytest.raises(CacheMismatchError, match="dtype='fp32'"):
        check_expectations(manifest, {"compute_dtype": "fp32"}, delivered="BF16")
    check_expectations(manifest, {"compute_dtype": "fp32", "dtype": "fp32"}, delivered="F32")
    dspark_cache.build_dataloader(
        fp8_cache, 2, dtype=torch.float32, expect={"compute_dtype": torch.float32}
    ).close()


def test_webdataset_handlers_dequantise_unless_asked_not_to(fp8_cache):
    cache = dspark_cache.open_cache(fp8_cache)
    expected = {s["sample_id"]: s for s in cache.samples()}
    urls = [cache.paths.shard_tar(i) for i in range(2)]
    seen = 0
    for sample in wds.WebDataset(urls, shardshuffle=False).decode(decode_dspark_sample):
        got = sample["safetensors"]
        for name in STATES:
            assert torch.equal(_bits(got[name]), _bits(expected[got["sample_id"]][name]))
        seen += 1
    raw = functools.partial(decode_dspark_arrays, dequantize=None)
    for sample in wds.WebDataset(urls[:1], shardshuffle=False).decode(raw):
        got = sample["safetensors"]
        assert got[HIDDEN].code == "F8_E4M3" and got[HIDDEN_SCALE].code == "F32"
        assert np.shares_memory(got[LAST_HIDDEN].array, got[HIDDEN].array)  # the final state is stored once
    assert seen == sum(len(s.samples) for s in cache.shards[:2])


# -- damaged scales -------------------------------------------------------------------------------


def _write_fp8_cache(root: str, bad_scale_at: tuple[int, int] | None, dtype: str = "fp8",
                     layer_ids: tuple[int, ...] = (0, 1), damage=None) -> CachePaths:
    """A one-shard FP8 cache of random states through the real writer (2-layer target, H=40: the C
    filler's 16-wide steps and its scalar tail both run), one scale set to NaN when asked;
    ``layer_ids`` without 1 store the final state apart. ``damage(codes, scales)`` edits sample 1's
    hidden states (uint8 codes, ``[9, 40 * len(layer_ids)]``) and scales (``[9, len(layer_ids)]``) in place."""
    paths = CachePaths(root)
    paths.ensure_dirs()
    code = CACHE_DTYPES[dtype]
    shape = SampleShape(layer_ids, 2, 40, code)
    writer = ShardWriter(paths, 0, durable=False)
    g = torch.Generator().manual_seed(3)
    for sid, n in enumerate([5, 9]):
        q, scales = quantize_fp8(torch.randn(n, 40 * len(layer_ids), generator=g) * 10, 40, code)
        if bad_scale_at is not None and sid == 1:
            scales[bad_scale_at] = float("nan")
        if damage is not None and sid == 1:
            damage(q.view(torch.uint8), scales)
        tensors = {HIDDEN: q, HIDDEN_SCALE: scales, "input_ids": torch.arange(n, dtype=torch.int32),
                   "loss_mask": torch.ones(n, dtype=torch.uint8)}
        if shape.stores_last:
            tensors[LAST_HIDDEN], tensors[LAST_HIDDEN_SCALE] = quantize_fp8(
                torch.randn(n, 40, generator=g), 40, code
            )
        writer.append(sid, n, shape.specs(n), shape.metadata(sid), byte_views(tensors))
    writer.publish()
    save_file({name: torch.randn(10, 40, generator=g) for name in ("embed_tokens.weight", "lm_head.weight")},
              paths.target_weights)  # dspark-convert needs them
    write_manifest(
        paths,
        Manifest(
            complete=True,
            target_model="t",
            target_model_type="qwen3",
            target_vocab_size=10,
            hidden_size=40,
            num_hidden_layers=2,
            seq_length=16,
            dtype=dtype,
            num_samples=2,
            planned_samples=2,
            shard_size=2,
            target_hidden_dim=40 * len(layer_ids),
            target_last_hidden_dim=40,
            target_layer_ids=list(layer_ids),
            train_data_path="d",
            num_shards=1,
        ),
    )
    return paths


@pytest.mark.parametrize("dtype", FP8_DTYPES)
@pytest.mark.parametrize("layer_ids", [(0, 1), (-1, 0)], ids=["final-in-ids", "final-apart"])
def test_both_formats_and_layouts_read_the_same_everywhere(tmp_path, executor, dtype, layer_ids):
    paths = _write_fp8_cache(str(tmp_path / "c"), None, dtype, layer_ids)
    raw = next(iter(dspark_cache.build_dataloader(paths.root, 2, shuffle=False, dtype="raw")))
    assert raw[HIDDEN].dtype == TORCH_FP8[CACHE_DTYPES[dtype]]
    samples = list(dspark_cache.open_cache(paths.root, dtype="fp32").samples())
    for out, torch_dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        batch = next(iter(dspark_cache.build_dataloader(paths.root, 2, shuffle=False, dtype=out)))
        for name in STATES:
            assert torch.equal(_bits(batch[name]), _bits(dspark_cache.dequantize(raw, torch_dtype)[name]))
            if out == "fp32":
                for row, sample in enumerate(samples):
                    n = sample["input_ids"].shape[0]
                    assert torch.equal(_bits(batch[name][row, :n]), _bits(sample[name]))


def test_a_bad_scale_is_refused_by_the_loader_and_dspark_verify(tmp_path, executor, capsys):
    from dspark_cache.verify import verify_cache

    good = _write_fp8_cache(str(tmp_path / "good"), None)
    assert not verify_cache(good.root).corrupt  # (it has no target weights: a problem of another kind)
    assert (
        next(iter(dspark_cache.build_dataloader(good.root, 2, shuffle=False)))[HIDDEN].dtype == torch.bfloat16
    )
    bad = _write_fp8_cache(str(tmp_path / "bad"), (6, 1))
    for dtype in (None, "raw"):  # raw batches' scales are checked too
        with pytest.raises(CorruptShardError, match=r"sample 1.*scale of token 6 is not a positive number"):
            next(iter(dspark_cache.build_dataloader(bad.root, 2, shuffle=False, dtype=dtype)))
    report = verify_cache(bad.root)
    assert (
        not report.ok
        and report.corrupt[0]["sample"] == 1
        and "token 6, column 1" in report.corrupt[0]["reason"]
    )


def test_nemo_path_reports_and_hands_out_the_recipe_dtype(fp8_cache, tmp_path):
    from dspark_cache.nemo import calls
    from dspark_cache.nemo.convert import convert_to_nemo
    from dspark_cache.nemo.nemo_format import NemoCacheDataset

    manifest = calls.read_manifest(fp8_cache)
    # CPU: the recipe computes in fp32
    assert (manifest["dtype"], manifest["stored_dtype"]) == ("fp32", "fp8")
    config = type(
        "Config",
        (),
        {
            "hidden_size": manifest["hidden_size"],
            "vocab_size": manifest["target_vocab_size"],
            "num_hidden_layers": manifest["num_hidden_layers"],
        },
    )()
    calls.validate_cached_dspark_manifest(fp8_cache, manifest, config, manifest["target_layer_ids"],
                                          target_model=manifest["target_model"],
                                          target_model_type=manifest["target_model_type"],
                                          seq_length=manifest["seq_length"], compute_dtype=torch.float32)
    loader = calls.build_cached_dspark_dataloader(cache_dir=fp8_cache, batch_size=4, shuffle=False)
    batch = next(iter(loader))
    assert batch[HIDDEN].dtype == torch.float32 and batch[HIDDEN].shape[1] == manifest["seq_length"]
    first = dspark_cache.open_cache(fp8_cache, dtype="fp32").read(0)
    n = first["input_ids"].shape[0]
    assert torch.equal(batch[HIDDEN][0, :n], first[HIDDEN])
    # dspark-convert --to nemo dequantises: NeMo's own layout has no FP8.
    convert_to_nemo(fp8_cache, str(tmp_path / "nemo"), dtype="fp32", progress=None)
    with open(nemo_format.manifest_path(str(tmp_path / "nemo"))) as handle:
        assert json.load(handle)["dtype"] == "fp32"
    row = NemoCacheDataset(str(tmp_path / "nemo"))[0]
    assert torch.equal(row[HIDDEN][:n], first[HIDDEN]) and not row[HIDDEN][n:].any()


def test_compute_dtype_fp8_is_refused_before_loading(embedded):
    from dspark_cache.producer.device.target import TargetError, TargetRunner

    with pytest.raises(TargetError, match="storage format"):
        TargetRunner(embedded.stock, [1], 4, torch.device("cpu"), "F8_E4M3", "F8_E4M3")


# -- the FP8 rule, everywhere (issue 23, item 4) ---------------------------------------------------


def _set_scale(value: float):
    def damage(codes: torch.Tensor, scales: torch.Tensor) -> None:
        scales[6, 1] = value
    return damage


def _set_code(value: int):
    def damage(codes: torch.Tensor, scales: torch.Tensor) -> None:
        codes[6, 40 + 17] = value  # token 6, the second layer's 18th column
    return damage


# (name, dtype, damage, what the message names). "bf16-overflow" is finite in float32 (3.3965e38) but
# rounds to inf as bf16, the loader's default; "overflow" is inf in float32 too.
DAMAGES = [
    ("nan-scale", "fp8", _set_scale(float("nan")), "scale of token 6"),
    ("inf-scale", "fp8", _set_scale(float("inf")), "scale of token 6"),
    ("zero-scale", "fp8", _set_scale(0.0), "scale of token 6"),
    ("negative-scale", "fp8", _set_scale(-0.5), "scale of token 6"),
    ("overflow", "fp8", _set_scale(1e36), "scale of token 6"),
    ("bf16-overflow", "fp8", _set_scale(3.3965e38 / 448), "scale of token 6"),
    ("e5m2-overflow", "fp8_e5m2", _set_scale(3.3965e38 / 57344), "scale of token 6"),
    ("e4m3-nan-code", "fp8", _set_code(0x7F), "states of token 6.* NaN or inf code"),
    ("e4m3-negative-nan-code", "fp8", _set_code(0xFF), "states of token 6.* NaN or inf code"),
    ("e5m2-inf-code", "fp8_e5m2", _set_code(0x7C), "states of token 6.* NaN or inf code"),
    ("e5m2-nan-code", "fp8_e5m2", _set_code(0xFE), "states of token 6.* NaN or inf code"),
]


@pytest.mark.parametrize("name, dtype, damage, says", DAMAGES, ids=[d[0] for d in DAMAGES])
def test_every_reader_refuses_a_bad_scale_or_code(tmp_path, executor, name, dtype, damage, says):
    from dspark_cache.format.errors import CacheError
    from dspark_cache.nemo.convert import convert_to_nemo
    from dspark_cache.verify import verify_cache

    paths = _write_fp8_cache(str(tmp_path / "c"), None, dtype, damage=damage)
    named = rf"shard-000000.tar \(sample 1\): .*{says}"
    for out in (None, "fp32", "raw"):
        with pytest.raises(CorruptShardError, match=named):
            list(dspark_cache.open_cache(paths.root, dtype=out).samples())
    for out in ("bf16", "fp32"):  # the executor's filler, C or Python
        with pytest.raises(CorruptShardError, match=named):
            list(dspark_cache.build_dataloader(paths.root, 2, shuffle=False, dtype=out, pin_memory=False))
    if "scale" in says:
        with pytest.raises(CorruptShardError, match=named):
            list(dspark_cache.build_dataloader(paths.root, 2, shuffle=False, dtype="raw", pin_memory=False))
    else:  # raw batches hand the codes out undecoded; dequantize decodes them, and refuses
        raw = next(
            iter(dspark_cache.build_dataloader(paths.root, 2, shuffle=False, dtype="raw", pin_memory=False))
        )
        with pytest.raises(ValueError, match=r"target_hidden_states of sample 1: .*token 6, column 1"):
            dspark_cache.dequantize(raw)
    for dequantize in ("BF16", None):  # WebDataset wraps the handler's error (its own names the tar)
        handler = functools.partial(decode_dspark_arrays, dequantize=dequantize)
        with pytest.raises(wds.autodecode.DecodingError) as raised:
            list(wds.WebDataset([paths.shard_tar(0)], shardshuffle=False).decode(handler))
        assert isinstance(raised.value.__cause__, CorruptShardError)
        assert re.search(rf"sample 1\): .*{says}", str(raised.value.__cause__))
    with pytest.raises(CacheError, match=named):
        convert_to_nemo(paths.root, str(tmp_path / "nemo"), progress=None)
    report = verify_cache(paths.root)
    assert (
        not report.ok
        and report.corrupt[0]["sample"] == 1
        and "token 6, column 1" in report.corrupt[0]["reason"]
    )
    assert report.corrupt[0]["rebuildable"] is False  # the writer's bytes: --repair deletes the shard


@pytest.mark.parametrize("value", [float("nan"), 0.0, -1.0, 1e36, 3.3965e38 / 448])
def test_dequantize_refuses_bad_scales_on_the_device_it_runs_on(tmp_path, value):
    paths = _write_fp8_cache(str(tmp_path / "c"), None)
    sample = next(iter(dspark_cache.open_cache(paths.root, dtype="raw").samples()))
    batch = next(
        iter(dspark_cache.build_dataloader(paths.root, 2, shuffle=False, dtype="raw", pin_memory=False))
    )
    dspark_cache.dequantize(sample), dspark_cache.dequantize(batch)  # intact: fine, pads included
    sample[HIDDEN_SCALE][3, 0] = value
    batch[HIDDEN_SCALE][1, 3, 0] = value
    with pytest.raises(ValueError, match=r"target_hidden_states: .*scale of token 3, column 0"):
        dspark_cache.dequantize(sample)
    with pytest.raises(ValueError, match=r"target_hidden_states of sample 1: .*scale of token 3, column 0"):
        dspark_cache.dequantize(batch)


def test_dequantize_to_fp16_refuses_scales_whose_states_overflow_fp16(tmp_path):
    paths = _write_fp8_cache(str(tmp_path / "c"), None)
    sample = next(iter(dspark_cache.open_cache(paths.root, dtype="raw").samples()))
    sample[HIDDEN_SCALE][2, 1] = 70000.0 / 448  # fine as bf16 and fp32, inf as fp16
    assert torch.isfinite(dspark_cache.dequantize(sample)[HIDDEN].float()).all()
    with pytest.raises(ValueError, match="scale of token 2, column 1"):
        dspark_cache.dequantize(sample, torch.float16)
