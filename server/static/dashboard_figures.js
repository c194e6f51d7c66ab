"use strict";
// The dashboard's headline figures from /v1/stats/history samples (server/history.py): functions of
// the samples only, no page, so that tests run this same file in node on a real server's samples
// (tests/server/test_dashboard_figures.py). The /dashboard route puts it into the page.

// Counters are cumulative; a drop means a restart (Prometheus' rule), so the growth after it counts.
function growth(samples, get) {
  let total = 0;
  for (let i = 1; i < samples.length; i++) total += stepGrowth(samples[i - 1], samples[i], get);
  return total;
}
function stepGrowth(a, b, get) { const x = get(a) || 0, y = get(b) || 0; return y >= x ? y - x : y; }

// Store reads: gets that hit, of all gets and every prefix lookup a missing key cut short. A lookup
// that stops at its first key reads nothing, so it is no get miss; left out, a store whose every
// lookup missed read "100%" from the few gets that hit.
function storeReads(samples) {
  const tiers = [...new Set(samples.flatMap(s => Object.keys(s.tiers || {})))];
  const hits = tiers.reduce((a, n) => a + growth(samples, s => (s.tiers[n] || {}).hits), 0);
  const misses = growth(samples, s => s.misses);
  const cutShort = growth(samples, s => s.lookups_cut_short);
  const all = hits + misses + cutShort;
  return {hits, misses, cutShort, rate: all ? hits / all : NaN};
}

// Prefill time the store saved, on a linear cost model: what a computed token costs the engines when
// the store serves nothing (prefill seconds per computed token, over the sample steps of every sample
// kept in which the store provided no token), times the tokens the engines did not find in their
// own cache (computed + the store's), less the prefill time actually spent. The old estimate took
// the cost per token from prefills that also loaded KV from the store, counting the load and every
// request's fixed overhead as compute: 18.3 s "saved" where the whole cold prefill took 2.1 s.
// `win`, `all`: samples with engine reports, in the window and all of them.
function prefillSaved(win, all) {
  const eng = f => x => x.engines[f];
  let coldSeconds = 0, coldTokens = 0, coldPrefills = 0;
  for (let i = 1; i < all.length; i++) {
    const a = all[i - 1], b = all[i];
    const computed = stepGrowth(a, b, eng("prompt_tokens")) - stepGrowth(a, b, eng("engine_hit_tokens"));
    const prefills = stepGrowth(a, b, eng("prefills"));
    if (stepGrowth(a, b, eng("store_hit_tokens")) === 0 && prefills > 0 && computed > 0) {
      coldSeconds += stepGrowth(a, b, eng("prefill_seconds"));
      coldTokens += computed;
      coldPrefills += prefills;
    }
  }
  const perToken = coldTokens > 0 ? coldSeconds / coldTokens : NaN;
  const P = growth(win, eng("prompt_tokens")), E = growth(win, eng("engine_hit_tokens"));
  const S = growth(win, eng("store_hit_tokens")), spent = growth(win, eng("prefill_seconds"));
  const computed = Math.max(0, P - E - S);
  return {seconds: S > 0 ? (computed + S) * perToken - spent : 0, perToken, coldPrefills, storeTokens: S};
}

if (typeof module !== "undefined") module.exports = {growth, stepGrowth, storeReads, prefillSaved};
