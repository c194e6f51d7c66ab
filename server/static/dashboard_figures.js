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

// The engines of a sample, each on its own ({metrics URL: fields, or null when it did not answer}); a
// sample of an older server holds only their sum, taken as one engine.
function enginesOf(s) { return s.engines.by_url || {"": s.engines}; }

// Prefill time the store saved (est.): the store's tokens times what a computed token costs, less
// what the prefills the store served took beyond computing their own tokens (loading its KV).
//
// The cost of a computed token pairs numbers observed together for the same requests when their
// prefill is over (server/engine_scrape.py): prefill seconds over `prefill_computed_tokens`, per
// engine, over the sample steps whose prefills the store cannot have served: those that computed
// every prompt token, and any while no request the store served was in flight on that engine (from a
// step in which the store served it tokens to the next sample that finds the engine idle). The token
// counters grow when a request is admitted, its prefill seconds when it is over: seconds of one step
// over the tokens of the same step paired one request's time with another's tokens (vLLM: a cold
// 2,915-token prefill of ~4 s read as 22.4 ms a token and 2.2 min saved, issue 43) or found no step.
// `win`, `all`: samples with engine reports, in the window and all of them (the cost comes from all).
function prefillSaved(win, all) {
  const t0 = win.length ? win[0].t : Infinity;
  let coldSeconds = 0, coldTokens = 0, coldPrefills = 0;
  const served = [];  // [seconds, computed tokens] of the window's steps whose prefills the store may have served
  for (const url of new Set(all.flatMap(s => Object.keys(enginesOf(s))))) {
    let prev = null, prevT = 0, busy = true;  // busy: a request the store served may be in its prefill
    for (const s of all) {
      const e = enginesOf(s)[url];
      if (!e) continue;  // down: the next step spans the gap
      if (prev) {
        const d = f => stepGrowth(prev, e, x => x[f]);
        if (d("store_hit_tokens") > 0) busy = true;
        const n = d("prefills"), seconds = d("prefill_seconds"), computed = d("prefill_computed_tokens");
        const known = "prefill_computed_tokens" in prev && "prefill_computed_tokens" in e;
        if (n > 0 && known && computed > 0) {
          if (!busy || d("prefill_prompt_tokens") === computed) {
            coldSeconds += seconds; coldTokens += computed; coldPrefills += n;
          } else if (prevT >= t0) served.push([seconds, computed]);
        }
      }
      if ((e.running || 0) + (e.waiting || 0) === 0) busy = false;
      prev = e; prevT = s.t;
    }
  }
  const perToken = coldTokens > 0 ? coldSeconds / coldTokens : NaN;
  const S = growth(win, x => x.engines.store_hit_tokens);
  const loadSeconds = Math.max(0, served.reduce((a, [seconds, computed]) => a + seconds - computed * perToken, 0));
  return {seconds: S > 0 ? S * perToken - loadSeconds : 0, perToken, coldPrefills, storeTokens: S, loadSeconds};
}

// `total` split over `weights` in whole parts that add up to it (largest remainders).
function splitWhole(total, weights) {
  const sum = weights.reduce((a, b) => a + b, 0);
  if (!(sum > 0)) return weights.map((_, i) => (i === 0 ? total : 0));
  const exact = weights.map(w => (total * w) / sum), parts = exact.map(Math.floor);
  let left = total - parts.reduce((a, b) => a + b, 0);
  const order = exact.map((x, i) => [x - parts[i], i]).sort((a, b) => b[0] - a[0]);
  for (let k = 0; left > 0 && k < order.length; k++, left--) parts[order[k][1]] += 1;
  return parts;
}

if (typeof module !== "undefined") module.exports = {growth, stepGrowth, storeReads, prefillSaved, splitWhole};
