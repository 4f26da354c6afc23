"""`kvserve bench soak`'s RSS summary: growth is measured from the end of the warm-up rounds."""

from kvserve.bench.soak import summarize


def samples(*rss):
    return [{"round": i, "rss_mib": r} for i, r in enumerate(rss)]


def test_growth_is_measured_from_the_last_warm_up_round():
    s = summarize(samples(300.0, 400.0, 404.0, 410.0), warmup_rounds=2)
    assert s["rss_after_warmup_mib"] == 400.0 and s["rss_last_mib"] == 410.0 and s["rss_max_mib"] == 410.0
    assert s["rounds_after_warmup"] == 2 and s["growth_after_warmup_pct"] == 2.5


def test_no_round_after_the_warm_up_measures_no_growth():
    for rss in [(300.0,), (300.0, 900.0)]:  # growth must not read 0% when nothing was measured
        s = summarize(samples(*rss), warmup_rounds=2)
        assert s["growth_after_warmup_pct"] is None and s["rss_after_warmup_mib"] is None
        assert s["rounds_after_warmup"] == 0 and s["rss_last_mib"] == rss[-1]


def test_no_warm_up_measures_from_the_first_round():
    s = summarize(samples(200.0, 220.0), warmup_rounds=0)
    assert s["rss_after_warmup_mib"] == 200.0 and s["growth_after_warmup_pct"] == 10.0
