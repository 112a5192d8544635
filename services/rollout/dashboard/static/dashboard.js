// The run dashboard: polls /dashboard/api/summary with the token from the URL fragment
// (#token=..., never sent to the server by the browser) and draws every panel.
"use strict";
(() => {
  const token = new URLSearchParams(location.hash.slice(1)).get("token") || "";
  const $ = id => document.getElementById(id);
  let openSample = null;

  async function api(path) {
    const response = await fetch(path, {headers: {Authorization: `Bearer ${token}`}});
    if (response.status === 401) {
      throw new Error("not authorised: open the URL printed by `riptide up` or " +
                      "`riptide dashboard` (it ends in #token=...)");
    }
    const body = await response.json();
    if (!response.ok) throw new Error(body.error ? body.error.message : response.statusText);
    return body;
  }

  function mark(panel, points) {
    document.querySelector(`[data-panel="${panel}"]`).dataset.points = String(points);
  }

  function table(node, columns, rows, onRow) {
    node.textContent = "";
    const head = node.insertRow();
    for (const [, title] of columns) {
      const th = document.createElement("th");
      th.textContent = title;
      head.appendChild(th);
    }
    for (const row of rows) {
      const tr = node.insertRow();
      for (const [key] of columns) {
        const v = typeof key === "function" ? key(row) : row[key];
        tr.insertCell().textContent = v === null || v === undefined ? "" :
          typeof v === "number" ? Charts.fmt(v) : String(v);
      }
      if (onRow) onRow(tr, row);
    }
    return rows.length;
  }

  const series = obj => Object.entries(obj).map(([name, points]) => ({name, points}));
  const pct = v => (v === null || v === undefined) ? "" : `${(100 * v).toFixed(0)}%`;

  function draw(s) {
    const state = $("run-state");
    state.textContent = s.live ? "live" : "finished run";
    state.className = `badge ${s.live ? "live" : "finished"}`;
    $("run-clock").textContent = `${s.num_events} events` +
      (s.now ? `, last at ${new Date(s.now * 1000).toLocaleTimeString()}` : "") +
      (s.num_bad_events ? `, ${s.num_bad_events} malformed skipped` : "");

    const adv = $("advisories");
    adv.textContent = "";
    for (const a of s.advisories) {
      const li = document.createElement("li");
      li.textContent = a.message + " ";
      const th = document.createElement("span");
      th.className = "advice-threshold";
      th.textContent = `[${a.threshold}]`;
      li.appendChild(th);
      adv.appendChild(li);
    }
    if (!s.advisories.length) {
      const li = document.createElement("li");
      li.className = "ok";
      li.textContent = "nothing looks wrong";
      adv.appendChild(li);
    }
    mark("advisories", s.num_events ? 1 : 0);

    const t = s.timeline;
    $("idle").textContent = t.idle_fraction === null ? "" :
      `trainer idle ${pct(t.idle_fraction)}`;
    mark("timeline", Charts.gantt($("timeline"), t));
    const xt = {xTime: true, tOrigin: t.t0};
    mark("concurrency", Charts.line($("concurrency"), [
      {name: "in flight", points: s.concurrency.in_flight},
      {name: "cap", points: s.concurrency.cap, dash: true}], xt));
    mark("per_engine", Charts.line($("per_engine"), series(s.concurrency.per_engine), xt));
    mark("per_rank", Charts.line($("per_rank"), series(s.concurrency.per_rank), xt));
    const cache = [];
    Object.entries(s.cache.engines).forEach(([name, p], i) => {
      const color = Charts.PALETTE[i % Charts.PALETTE.length];
      cache.push({name, points: p.cumulative, color});
      cache.push({name: `${name} ${s.cache.window_s}s`, points: p.windowed, color, dash: true,
                  hideLegend: true});
    });
    mark("cache", Charts.line($("cache"), cache, {...xt, yMin: 0, yMax: 1}));
    mark("staleness", Charts.bars($("staleness"), s.staleness,
                                  {xLabel: "weight versions behind"}));
    mark("dropped", Charts.bars($("dropped"), s.dropped, {emptyText: "no group dropped"}));
    mark("no_verdict_causes", Charts.bars($("no_verdict_causes"), s.no_verdict_causes,
                                          {emptyText: "every episode has a verdict"}));
    const byStep = key => s.steps.filter(r => r[key] !== null && r[key] !== undefined)
      .map(r => [r.step, r[key]]);
    const xs = {xLabel: "step"};
    mark("step_time", Charts.line($("step_time"), [{name: "step time", points: byStep("step_time_s")}], xs));
    mark("tokens_per_s", Charts.line($("tokens_per_s"),
                                     [{name: "tokens/s", points: byStep("tokens_per_s")}], xs));
    mark("reward", Charts.line($("reward"), [{name: "reward", points: byStep("reward_mean")},
      {name: "success rate", points: byStep("success_rate")}], xs));
    mark("evals", Charts.line($("evals"), [{name: "held-out success",
      points: s.evals.map(e => [e.weight_version, e.mean_success])}],
      {xLabel: "weight version", yMin: 0}));
    mark("engines", table($("engines"), [["engine", "engine"], ["dp_rank", "dp rank"],
      ["state", "state"], ["running", "running"], ["waiting", "waiting"], [r => pct(r.hit_rate), "cache hits"],
      [r => r.healthy ? "healthy" : "unhealthy", "health"], ["weight_version", "weights"],
      ["circuit", "circuit"], [r => r.load_signal || "", "load signal"]], s.engines));
    mark("sandbox_lifecycle", table($("sandbox_lifecycle"), [["service", "service"],
      ["incarnation", "incarnation"], ["live", "live"], ["leased", "leased"],
      ["reaped", "reaped"], ["failed_deletes", "failed deletes"],
      [r => r.reporting ? "yes" : "gone", "reporting"]], s.sandbox_lifecycle));
    mark("sandboxes", table($("sandboxes"), [["sandbox", "sandbox"], ["task_id", "task"],
      ["provider", "provider"], ["sample_id", "sample"], ["state", "state"],
      ["turns", "turns"], ["age_s", "age (s)"]], s.sandboxes));
    mark("samples", table($("samples"), [["sample_id", "sample"], ["task_id", "task"],
      ["reward", "reward"], ["verdict", "verdict"], ["turns", "turns"],
      ["response_tokens", "resp. tokens"], ["engine", "engine"], ["dp_rank", "dp"],
      ["weight_version", "weights"], [r => r.truncated ? "yes" : "", "truncated"],
      [r => r.aborted ? "yes" : "", "aborted"]], s.samples, (tr, row) => {
        if (!row.has_detail && !s.follows) return;
        tr.dataset.sample = row.sample_id;
        tr.addEventListener("click", () => showSample(row.sample_id));
      }));
  }

  function tokenColor(logprob) {
    // Green when the engine was sure of the token, red when it was not (log-prob <= -5).
    const x = Math.max(0, Math.min(1, -(logprob ?? 0) / 5));
    return `hsl(${Math.round(120 * (1 - x))}, 70%, 82%)`;
  }

  async function showSample(id) {
    openSample = id;
    const panel = $("sample-panel"), box = $("sample");
    panel.hidden = false;
    $("sample-title").textContent = id;
    box.textContent = "loading...";
    let v;
    try {
      v = await api(`/dashboard/api/samples/${encodeURIComponent(id)}`);
    } catch (err) {
      box.textContent = err.message;
      mark("sample", 0);
      return;
    }
    box.textContent = "";
    const head = document.createElement("p");
    head.textContent = `task ${v.task_id}, group ${v.group_id}, reward ${v.reward}, ` +
                       `verdict ${v.verdict}`;
    box.appendChild(head);
    v.turns.forEach((turn, i) => {
      const div = document.createElement("div");
      div.className = "turn";
      const add = (cls, text, label) => {
        const b = document.createElement("b");
        b.textContent = label;
        const pre = document.createElement("pre");
        pre.className = cls;
        pre.textContent = text;
        div.append(b, pre);
      };
      add("assistant", turn.assistant, `turn ${i + 1}: assistant`);
      for (const c of turn.commands) add("command", c, "command");
      add("observation", turn.observation, "observation");
      box.appendChild(div);
    });
    const legend = document.createElement("p");
    legend.className = "note";
    legend.textContent = "tokens: grey = not trained on (loss mask 0); coloured = trained on, " +
                         "green to red by falling log-prob (hover for the value)";
    box.appendChild(legend);
    const tokens = document.createElement("div");
    tokens.className = "tokens";
    for (const tk of v.tokens) {
      const span = document.createElement("span");
      span.className = tk.loss ? "tok" : "tok prompt";
      span.textContent = tk.text;
      if (tk.loss) span.style.background = tokenColor(tk.logprob);
      span.title = `loss mask ${tk.loss ? 1 : 0}, log-prob ${tk.logprob ?? "n/a"}`;
      tokens.appendChild(span);
    }
    box.appendChild(tokens);
    mark("sample", v.turns.length + v.tokens.length);
    panel.scrollIntoView({block: "nearest"});
  }

  async function poll() {
    let delay = 5000;
    try {
      const s = await api("/dashboard/api/summary");
      $("error").textContent = "";
      draw(s);
      document.body.dataset.loaded = String(Number(document.body.dataset.loaded || 0) + 1);
      if (!s.follows) return;  // a saved run does not change
      delay = s.poll_interval_ms;
    } catch (err) {
      $("error").textContent = err.message;
    }
    setTimeout(poll, delay);
  }

  window.riptideDashboard = {showSample, openSample: () => openSample};
  poll();
})();
