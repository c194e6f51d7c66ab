"use strict";
// The router dashboard's figures from /v1/router/state (engine/router/app.py Router.state): functions
// of that JSON only, no page, so that tests run this same file in node on a real router's state
// (tests/router/test_router_app.py). The /dashboard route puts it into the page.

const STATE_URL = "/v1/router/state";

// One panel per engine: its load now, its share of all decisions, where its prompt tokens came from
// (local cache / loaded from the store / computed, as shares of its routed prompt tokens) and the
// p50s of its recent predicted and actual (streamed requests) TTFTs.
function enginePanels(state) {
  return Object.entries(state.engines || {}).map(([url, e]) => {
    const t = e.tokens || {}, local = t.local || 0, remote = t.remote || 0, miss = t.miss || 0;
    const tokens = local + remote + miss;
    const decisions = Object.values(e.decisions || {}).reduce((a, b) => a + b, 0);
    return {
      url, up: !!e.up, inFlight: e.in_flight, waitingTokens: e.waiting_tokens,
      decisions, byPolicy: e.decisions || {}, share: e.share, capped: e.capped || 0,
      predictedP50: e.predicted_ttft_p50_s ?? NaN, actualP50: e.actual_ttft_p50_s ?? NaN, ttftSamples: e.ttft_samples || 0,
      tokens, local: tokens ? local / tokens : NaN, remote: tokens ? remote / tokens : NaN, miss: tokens ? miss / tokens : NaN,
    };
  });
}

// The fleet's figures: decisions, prompt tokens and their local/remote/miss shares over all engines,
// and the imbalance (most decisions on one engine over the mean).
function fleetTotals(panels) {
  const decisions = panels.reduce((a, p) => a + p.decisions, 0);
  const tokens = panels.reduce((a, p) => a + p.tokens, 0);
  const part = k => tokens ? panels.reduce((a, p) => a + (p.tokens ? p[k] * p.tokens : 0), 0) / tokens : NaN;
  const mean = panels.length ? decisions / panels.length : 0;
  const most = Math.max(0, ...panels.map(p => p.decisions));
  return {decisions, tokens, local: part("local"), remote: part("remote"), miss: part("miss"),
    imbalance: mean ? most / mean : NaN};
}

if (typeof module !== "undefined") module.exports = {STATE_URL, enginePanels, fleetTotals};
