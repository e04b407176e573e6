"""benchmarks/hostile.py end to end, briefly: one honest caller, three probes; its JSON's shape
and that each probe was refused as the server's bounds say (not its timing figures)."""

from __future__ import annotations

from pathlib import Path

from tests.benchmarks.test_pipeline_benches import bench


def test_hostile_benchmark_probes_are_refused_beside_an_honest_call(tmp_path: Path) -> None:
    args = ("--callers", "1", "--probe-s", "1", "--settle-s", "0.5")
    args += ("--probes", "none,offers,secret_reuse", "--json", str(tmp_path / "h.json"))
    data, stdout = bench("hostile.py", *args, limit_s=150)
    rows = {r["name"]: r for r in data["probes"]}
    assert list(rows) == ["none", "offers", "secret_reuse"]
    for r in rows.values():
        assert set(r) >= {"honest_late_frame_ratio", "healthz_worst_ms", "rss_growth_mb", "status"}
        assert 0 <= r["honest_late_frame_ratio"] <= 1 and r["healthz_worst_ms"] > 0
    assert set(rows["offers"]["status"]) == {"413", "400"}  # every offer past a bound refused
    assert rows["secret_reuse"]["status"]["client_secret_used"] == 1
    assert "probes within the targets" in stdout
