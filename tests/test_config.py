"""Options and sizes: every bad input gives one clear error."""
import pytest

from zinf_compile.config import ZinfConfig
from zinf_compile.errors import ZinfConfigError
from zinf_compile.units import format_bytes, parse_bytes


@pytest.mark.parametrize("text,n", [("300MB", 300 * 10**6), ("2GiB", 2 * 2**30), ("1.5 gb", 1_500_000_000),
                                    (4096, 4096), ("512", 512), ("64kib", 65536)])
def test_parse_bytes(text, n):
    assert parse_bytes(text) == n


@pytest.mark.parametrize("bad", ["lots", "12 parsecs", "-3MB", 0, True, None, "1e"])
def test_parse_bytes_rejects(bad):
    with pytest.raises(ZinfConfigError, match="budget"):
        parse_bytes(bad)


def test_format_bytes():
    assert format_bytes(3 * 2**20) == "3.00 MiB"
    assert format_bytes(512) == "512 B"


def test_unknown_option_lists_valid_ones():
    with pytest.raises(ZinfConfigError, match=r"unknown zinf option\(s\) 'budjet'.*valid options are: budget"):
        ZinfConfig.from_options({"budjet": "1GB"})


def test_bad_values():
    with pytest.raises(ZinfConfigError, match="offload: expected"):
        ZinfConfig.from_options({"offload": "tape"})
    with pytest.raises(ZinfConfigError, match="io_threads"):
        ZinfConfig.from_options({"io_threads": 0})
    with pytest.raises(ZinfConfigError, match="cannot parse 'huge'"):
        ZinfConfig.from_options({"budget": "huge"})


def test_defaults():
    cfg = ZinfConfig.from_options(None)
    assert cfg.budget is None and cfg.offload == "auto"
    assert cfg.tier_for("cpu") == "nvme" and cfg.tier_for("cuda") == "cpu"
    assert ZinfConfig.from_options({"budget": "1GB"}).key() != cfg.key()


def test_tiling_option():
    assert ZinfConfig.from_options(None).tiling == "auto"
    assert ZinfConfig.from_options({"tiling": "off"}).tiling == "off"
    cfg = ZinfConfig.from_options({"tiling": {"max_tile_bytes": "64MiB"}})
    assert (cfg.tiling, cfg.max_tile_bytes) == ("force", 64 << 20)
    assert cfg.key() != ZinfConfig.from_options({"tiling": {"max_tile_bytes": "32MiB"}}).key()
    with pytest.raises(ZinfConfigError, match="tiling: expected 'auto', 'off'"):
        ZinfConfig.from_options({"tiling": "on"})
    with pytest.raises(ZinfConfigError, match="tiling: expected {'max_tile_bytes': n}"):
        ZinfConfig.from_options({"tiling": {"tile": 3}})
    with pytest.raises(ZinfConfigError, match="tiling.max_tile_bytes"):
        ZinfConfig.from_options({"tiling": {"max_tile_bytes": "big"}})
