// areal-env view: the page. Preact + htm (no build step), uPlot for the charts.
// Routes (in the URL's hash): #/ runs · #/r/RUN overview · #/r/RUN/step/N · #/r/RUN/session/ID
// · #/r/RUN/eval?before=V&after=V&filter=F. Everything comes from the JSON API (app.py).
import { h, render } from "preact";
import { useEffect, useMemo, useRef, useState } from "preact/hooks";
import htm from "htm";

const html = htm.bind(h);
const POLL_MS = 4000;

// ---- data -------------------------------------------------------------------------------------

async function api(path, params = {}) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) if (v !== undefined && v !== null && v !== "") q.set(k, v);
  const r = await fetch(`/api/${path}?${q}`, { credentials: "same-origin" });
  let body = null;
  try { body = await r.json(); } catch (e) { /* not JSON */ }
  if (!r.ok) throw new Error((body && body.error && body.error.message) || `${r.status} ${r.statusText}`);
  return body;
}

// Fetch on mount and whenever deps change; with `poll`, again every POLL_MS (a run that trains).
function useApi(path, params, deps, poll = false) {
  const [state, setState] = useState({ data: null, error: null, loading: true });
  const [tick, setTick] = useState(0);
  useEffect(() => {
    if (!poll) return undefined;
    const t = setInterval(() => setTick((x) => x + 1), POLL_MS);
    return () => clearInterval(t);
  }, [poll]);
  useEffect(() => {
    let live = true;
    api(path, params).then(
      (data) => live && setState({ data, error: null, loading: false }),
      (error) => live && setState((s) => ({ data: s.data, error, loading: false })),
    );
    return () => { live = false; };
  }, [...deps, tick]);
  return state;
}

// ---- routing ----------------------------------------------------------------------------------

function parseHash() {
  const raw = location.hash.replace(/^#/, "") || "/";
  const [path, query] = raw.split("?");
  const params = Object.fromEntries(new URLSearchParams(query || ""));
  const parts = path.split("/").filter(Boolean).map(decodeURIComponent);
  return { parts, params };
}

function useRoute() {
  const [route, setRoute] = useState(parseHash());
  useEffect(() => {
    const on = () => { setRoute(parseHash()); window.scrollTo(0, 0); };
    addEventListener("hashchange", on);
    return () => removeEventListener("hashchange", on);
  }, []);
  return route;
}

const enc = encodeURIComponent;
const runHref = (run) => `#/r/${enc(run)}`;
const stepHref = (run, step) => `#/r/${enc(run)}/step/${step}`;
const sessionHref = (run, sid) => `#/r/${enc(run)}/session/${enc(sid)}`;
const evalHref = (run, p = {}) => `#/r/${enc(run)}/eval?${new URLSearchParams(p)}`;

// ---- small pieces -----------------------------------------------------------------------------

const fmt = (v, d = 3) => (v === null || v === undefined ? "–" : typeof v === "number" ? (Number.isInteger(v) ? String(v) : v.toFixed(d)) : String(v));
const pct = (v) => (v === null || v === undefined ? "–" : `${(100 * v).toFixed(1)}%`);
function ago(s) {
  if (s === null || s === undefined) return "never";
  if (s < 60) return `${Math.round(s)} s ago`;
  if (s < 3600) return `${Math.round(s / 60)} min ago`;
  return `${(s / 3600).toFixed(1)} h ago`;
}

function ErrorBox({ error }) {
  return error ? html`<div class="error" data-testid="error">${error.message || String(error)}</div>` : null;
}

function Pager({ total, offset, limit, onChange }) {
  if (total <= limit) return null;
  const last = Math.max(0, Math.floor((total - 1) / limit) * limit);
  return html`<div class="pager" data-testid="pager">
    <button disabled=${offset === 0} onClick=${() => onChange(0)}>« first</button>
    <button disabled=${offset === 0} onClick=${() => onChange(Math.max(0, offset - limit))}>‹ prev</button>
    <span>${offset + 1}–${Math.min(total, offset + limit)} of ${total}</span>
    <button disabled=${offset >= last} onClick=${() => onChange(offset + limit)}>next ›</button>
    <button disabled=${offset >= last} onClick=${() => onChange(last)}>last »</button>
  </div>`;
}

function Badge({ kind, children, title }) {
  return html`<span class=${`badge ${kind || ""}`} title=${title || ""}>${children}</span>`;
}

function RewardBadge({ value }) {
  if (value === null || value === undefined) return html`<${Badge} kind="muted">no reward<//>`;
  const kind = value > 0 ? "good" : value < 0 ? "bad" : "zero";
  return html`<${Badge} kind=${kind} title="reward">r = ${fmt(value)}<//>`;
}

function Crumbs({ run, single, items }) {
  return html`<nav class="crumbs">
    <a href="#/" class="brand">areal-env view</a>
    ${!single && html`<span>›</span><a href="#/">runs</a>`}
    ${run && html`<span>›</span><a href=${runHref(run)} data-testid="crumb-run">${run === "." ? "run" : run}</a>`}
    ${(items || []).map(([label, href]) => html`<span>›</span>${href ? html`<a href=${href}>${label}</a>` : html`<b>${label}</b>`}`)}
  </nav>`;
}

// ---- runs ---------------------------------------------------------------------------------------

function RunsPage() {
  const { data, error } = useApi("runs", {}, [], true);
  useEffect(() => {
    if (data && data.runs.length === 1 && data.runs[0].id === ".") location.replace(runHref("."));
  }, [data]);
  return html`<div>
    <${Crumbs} />
    <h1>Runs under <code>${data ? data.root : "…"}</code></h1>
    <${ErrorBox} error=${error} />
    ${data && data.runs.length === 0 && html`<p class="note" data-testid="no-runs">No run here yet. A run folder holds
      metrics.jsonl, config.yaml or rollout/ (fileroot/experiment/trial); this page refreshes as runs appear.</p>`}
    ${data && data.runs.length > 0 && html`<table class="grid">
      <thead><tr><th>run</th><th>status</th><th>step</th><th>updated</th></tr></thead>
      <tbody>${data.runs.map((r) => html`<tr>
        <td><a href=${runHref(r.id)} data-testid="run-link">${r.id}</a></td>
        <td>${r.live ? html`<${Badge} kind="live">training<//>` : html`<${Badge} kind="muted">stopped<//>`}</td>
        <td>${r.last_step}${r.total_steps ? ` / ${r.total_steps}` : ""}</td>
        <td>${ago(r.age_s)}</td></tr>`)}</tbody></table>`}
  </div>`;
}

// ---- charts -------------------------------------------------------------------------------------

const DEFAULT_CHARTS = [
  "reward/mean", "eval/success_rate", "actor/approx_kl", "actor/clip_frac", "actor/entropy",
  "perf/tokens_per_s", "mem/peak_rss_gb", "actor/grad_norm",
];

// Tick and value labels that stay readable from 1e-9 (a KL) to 1e6 (a gradient norm).
function num(v) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  const a = Math.abs(v);
  if (a !== 0 && (a >= 1e5 || a < 1e-3)) return v.toExponential(a >= 1e5 ? 1 : 2);
  return String(+v.toPrecision(4));
}

function Chart({ title, xs, ys, onPick }) {
  const box = useRef(null);
  const plot = useRef(null);
  useEffect(() => {
    const el = box.current;
    if (!el || !window.uPlot) return undefined;
    const opts = {
      width: Math.max(240, el.clientWidth), height: 170,
      scales: { x: { time: false } },
      legend: { show: false },
      cursor: { drag: { x: false, y: false } },
      axes: [
        { label: "step", size: 34, incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000] },
        { size: 80, values: (u, splits) => splits.map(num) },
      ],
      series: [{}, { label: title, stroke: "#2f6fdf", width: 2, points: { size: 5, show: true }, spanGaps: true }],
    };
    const u = new window.uPlot(opts, [xs, ys], el);
    plot.current = u;
    const click = () => {
      const i = u.cursor.idx;
      if (i !== null && i !== undefined && onPick) onPick(u.data[0][i]);
    };
    u.over.addEventListener("click", click);
    const resize = new ResizeObserver(() => {
      const w = Math.max(240, el.clientWidth);
      if (Math.abs(w - u.width) > 1) u.setSize({ width: w, height: 170 });
    });
    resize.observe(el);
    return () => { resize.disconnect(); u.over.removeEventListener("click", click); u.destroy(); plot.current = null; };
  }, [title]);
  useEffect(() => { if (plot.current) plot.current.setData([xs, ys]); }, [xs, ys]);
  const last = ys.length ? ys[ys.length - 1] : null;
  return html`<div class="chart" data-testid="chart" data-key=${title}>
    <div class="chart-title">${title} <span class="muted">${last === null ? "" : num(last)}</span></div>
    <div ref=${box} class="plot"></div></div>`;
}

function Charts({ run, metrics, evals, keys }) {
  const [extra, setExtra] = useState([]);
  const series = useMemo(() => {
    const out = {};
    const shown = [...DEFAULT_CHARTS, ...extra];
    for (const key of shown) {
      if (key === "eval/success_rate") {
        if (evals.length) out[key] = [evals.map((e) => e.step), evals.map((e) => e.success_rate)];
        continue;
      }
      const pts = metrics.filter((m) => typeof m[key] === "number");
      if (pts.length) out[key] = [pts.map((m) => m.step), pts.map((m) => m[key])];
    }
    return out;
  }, [metrics, evals, extra]);
  const pick = (step) => { location.hash = stepHref(run, step); };
  const others = keys.filter((k) => !DEFAULT_CHARTS.includes(k) && !extra.includes(k));
  return html`<section>
    <h2>Metrics <span class="muted small">(click a point to open its step)</span></h2>
    ${Object.keys(series).length === 0 && html`<p class="note">No metrics yet (metrics.jsonl is written after each step).</p>`}
    <div class="charts">${Object.entries(series).map(([k, [xs, ys]]) => html`<${Chart} key=${k} title=${k} xs=${xs} ys=${ys} onPick=${pick} />`)}</div>
    ${others.length > 0 && html`<label class="small">add a chart:
      <select data-testid="add-chart" onChange=${(e) => { if (e.target.value) setExtra([...extra, e.target.value]); e.target.value = ""; }}>
        <option value="">metric…</option>${others.map((k) => html`<option value=${k}>${k}</option>`)}</select></label>`}
  </section>`;
}

// ---- overview -----------------------------------------------------------------------------------

function EvalTable({ run, evals }) {
  if (!evals.length) return null;
  return html`<section>
    <h2>Held-out evaluation <a class="small" href=${evalHref(run)} data-testid="eval-link">compare before / after ›</a></h2>
    <table class="grid" data-testid="eval-table">
      <thead><tr><th>step</th><th>version</th><th>success</th><th>95% CI</th><th>reward</th><th>valid tool calls</th><th>turns</th><th>n</th></tr></thead>
      <tbody>${evals.map((e) => html`<tr>
        <td>${e.step}</td><td>${e.version}</td><td><b>${pct(e.success_rate)}</b></td>
        <td>${pct(e.success_ci_low)}–${pct(e.success_ci_high)}</td><td>${fmt(e.reward_mean)}</td>
        <td>${pct(e.valid_tool_call_rate)}</td><td>${fmt(e.turns_mean, 2)}</td><td>${fmt(e.n)}</td></tr>`)}</tbody>
    </table></section>`;
}

function StepsTable({ run, live }) {
  const [offset, setOffset] = useState(0);
  const limit = 25;
  const { data, error } = useApi("steps", { run, offset, limit }, [run, offset], live);
  return html`<section>
    <h2>Steps</h2><${ErrorBox} error=${error} />
    ${data && data.total === 0 && html`<p class="note">No step finished yet.</p>`}
    ${data && data.total > 0 && html`<table class="grid clickable" data-testid="steps-table">
      <thead><tr><th>step</th><th>version</th><th>episodes</th><th>rejected</th><th>groups (no signal)</th>
        <th>reward</th><th>clip frac</th><th>approx KL</th><th>tokens</th></tr></thead>
      <tbody>${data.items.map((s) => html`<tr data-testid="step-row" data-step=${s.step} onClick=${() => { location.hash = stepHref(run, s.step); }}>
        <td><a href=${stepHref(run, s.step)}>${s.step}</a></td><td>${s.versions.join(", ") || "–"}</td>
        <td>${s.sessions}</td><td>${s.rejected || ""}</td><td>${s.groups}${s.zero_variance_groups ? ` (${s.zero_variance_groups})` : ""}</td>
        <td>${fmt(s.reward_mean)}</td><td>${fmt(s.metrics["actor/clip_frac"])}</td><td>${num(s.metrics["actor/approx_kl"])}</td>
        <td>${s.token_parts ? "✓" : ""}</td></tr>`)}</tbody></table>`}
    ${data && html`<${Pager} total=${data.total} offset=${offset} limit=${limit} onChange=${setOffset} />`}
  </section>`;
}

function OverviewPage({ run, single }) {
  const ov = useApi("run", { run }, [run], true);
  const [metrics, setMetrics] = useState([]);
  const since = useRef(-1);
  const [tick, setTick] = useState(0);
  useEffect(() => { since.current = -1; setMetrics([]); }, [run]);
  useEffect(() => {
    const t = setInterval(() => setTick((x) => x + 1), POLL_MS);
    return () => clearInterval(t);
  }, []);
  useEffect(() => {
    api("metrics", { run, since: since.current }).then((d) => {
      if (!d.records.length) return;
      since.current = d.records[d.records.length - 1].step;
      setMetrics((m) => [...m, ...d.records]);
    }, () => {});
  }, [run, tick]);
  const o = ov.data;
  const live = !!(o && o.status.live);
  return html`<div>
    <${Crumbs} run=${run} single=${single} />
    <h1>${o ? o.path : "…"}</h1>
    <${ErrorBox} error=${ov.error} />
    ${o && html`<p class="status" data-testid="run-status">
      ${live ? html`<${Badge} kind="live">training<//>` : html`<${Badge} kind="muted">stopped<//>`}
      step <b data-testid="last-step">${o.status.last_step}</b>${o.status.total_steps ? ` of ${o.status.total_steps}` : ""}${" "}
      · ${o.sessions} episodes dumped · token record: ${o.token_record.steps} step(s), ${(o.token_record.bytes / 1024).toFixed(0)} KiB
      · updated ${ago(o.status.age_s)}</p>`}
    ${o && o.warnings.length > 0 && html`<div class="warn" data-testid="warnings"><b>Note:</b><ul>${o.warnings.map((w) => html`<li>${w}</li>`)}</ul></div>`}
    ${o && html`<${Charts} run=${run} metrics=${metrics} evals=${o.evals} keys=${o.metric_keys} />`}
    ${o && html`<${EvalTable} run=${run} evals=${o.evals} />`}
    <${StepsTable} run=${run} live=${live} />
    ${o && html`<section><h2>Configuration</h2>
      ${o.config ? html`<details data-testid="config"><summary>config.yaml</summary><pre>${o.config}</pre></details>`
        : html`<p class="note">No config.yaml in this run folder (runs write it from this version on).</p>`}
      ${o.checkpoints.length > 0 && html`<p class="small">checkpoints: ${o.checkpoints.join(", ")}</p>`}</section>`}
  </div>`;
}

// ---- step ---------------------------------------------------------------------------------------

function StepPage({ run, step, single }) {
  const detail = useApi("step", { run, step }, [run, step], true);
  const [groupsOffset, setGroupsOffset] = useState(0);
  const groups = useApi("groups", { run, step, offset: groupsOffset, limit: 20 }, [run, step, groupsOffset], true);
  const [filter, setFilter] = useState({ group: "", status: "all", sort: "order", q: "" });
  const [offset, setOffset] = useState(0);
  const limit = 50;
  const sessions = useApi("sessions", { run, step, offset, limit, ...filter }, [run, step, offset, JSON.stringify(filter)], true);
  const set = (k, v) => { setFilter({ ...filter, [k]: v }); setOffset(0); };
  const d = detail.data;
  const rec = (d && d.record) || {};
  return html`<div>
    <${Crumbs} run=${run} single=${single} items=${[[`step ${step}`]]} />
    <h1>Step ${step}</h1>
    <${ErrorBox} error=${detail.error} />
    ${d && html`<div class="kv" data-testid="step-summary">
      <span>versions <b>${d.versions.join(", ") || "–"}</b></span>
      <span>episodes <b>${d.sessions}</b> (${d.accepted} accepted, ${d.rejected} rejected)</span>
      <span>groups <b>${d.groups}</b>, without signal ${d.zero_variance_groups}</span>
      <span>reward mean <b>${fmt(rec["reward/mean"])}</b></span>
      <span>clip frac <b>${fmt(rec["actor/clip_frac"])}</b></span>
      <span>approx KL <b>${num(rec["actor/approx_kl"])}</b></span>
      <span>entropy <b>${fmt(rec["actor/entropy"])}</b></span>
      <span>update ${rec["actor/update_skipped"] ? html`<b class="bad">skipped</b>` : html`<b>done</b>`}</span>
      <span>token record: ${d.token_record.length ? d.token_record.map((p) => `${p.rows} rows, ${p.trained_tokens} trained tokens, ${(p.bytes / 1024).toFixed(1)} KiB`).join("; ") : "none"}</span>
    </div>`}
    <section><h2>Groups</h2><${ErrorBox} error=${groups.error} />
      ${groups.data && html`<table class="grid clickable" data-testid="groups-table">
        <thead><tr><th>group</th><th>task</th><th>episodes</th><th>accepted</th><th>reward mean</th><th>std</th><th></th></tr></thead>
        <tbody>${groups.data.items.map((g) => html`<tr class=${filter.group === g.group ? "selected" : ""} data-testid="group-row" onClick=${() => set("group", filter.group === g.group ? "" : g.group)}>
          <td><code>${g.group.slice(0, 16)}</code></td><td>${g.task_id}</td><td>${g.sessions}</td><td>${g.accepted}</td>
          <td>${fmt(g.reward_mean)}</td><td>${fmt(g.reward_std)}</td><td>${g.zero_variance ? html`<${Badge} kind="muted" title="every member got the same reward: no gradient">no signal<//>` : ""}</td></tr>`)}</tbody></table>
        <${Pager} total=${groups.data.total} offset=${groupsOffset} limit=${20} onChange=${setGroupsOffset} />`}
    </section>
    <section><h2>Episodes ${filter.group && html`<span class="small">of group <code>${filter.group.slice(0, 16)}</code> <button class="link" onClick=${() => set("group", "")}>(all groups)</button></span>`}</h2>
      <div class="filters">
        <select value=${filter.status} onChange=${(e) => set("status", e.target.value)} data-testid="status-filter">
          <option value="all">all</option><option value="accepted">accepted</option><option value="rejected">rejected</option>
          <option value="failed_tool_calls">failed tool calls</option></select>
        <select value=${filter.sort} onChange=${(e) => set("sort", e.target.value)} data-testid="sort">
          <option value="order">in order</option><option value="-reward">reward ↓</option><option value="reward">reward ↑</option><option value="-tokens">tokens ↓</option></select>
        <input placeholder="task or session id" value=${filter.q} onInput=${(e) => set("q", e.target.value)} />
      </div>
      <${ErrorBox} error=${sessions.error} />
      ${sessions.data && html`<table class="grid clickable" data-testid="sessions-table">
        <thead><tr><th>session</th><th>task</th><th>member</th><th>status</th><th>reward</th><th>completions</th><th>tokens out</th><th>tool calls</th><th>token record</th></tr></thead>
        <tbody>${sessions.data.items.map((s) => html`<tr data-testid="session-row" data-session=${s.session_id} onClick=${() => { location.hash = sessionHref(run, s.session_id); }}>
          <td><a href=${sessionHref(run, s.session_id)}><code>${s.session_id.slice(0, 18)}</code></a></td><td>${s.task_id}</td><td>${fmt(s.traj_index)}</td>
          <td>${s.accepted === false ? html`<${Badge} kind="bad" title=${s.error || ""}>rejected: ${s.reason}<//>` : html`<${Badge} kind="good">accepted<//>`}</td>
          <td>${fmt(s.reward)}</td><td>${s.completions}</td><td>${s.output_tokens}</td>
          <td>${s.tool_calls}${s.failed_tool_calls ? html` <${Badge} kind="bad">${s.failed_tool_calls} failed<//>` : ""}</td>
          <td>${s.has_tokens ? "✓" : ""}</td></tr>`)}</tbody></table>
        <${Pager} total=${sessions.data.total} offset=${offset} limit=${limit} onChange=${setOffset} />`}
    </section>
  </div>`;
}

// ---- session: the conversation tree -------------------------------------------------------------

function Message({ m }) {
  const role = m.role || "?";
  let content = m.content;
  if (Array.isArray(content)) content = content.map((p) => (typeof p === "string" ? p : p.text || `[${p.type}]`)).join("");
  if (content && typeof content !== "string") content = JSON.stringify(content);
  return html`<div class=${`msg role-${role}`}>
    <span class="role">${role}${m.tool_call_id ? html` <span class="muted">(${m.name || "result"} · ${String(m.tool_call_id).slice(0, 10)})</span>` : ""}</span>
    ${content ? html`<pre class="text">${content}</pre>` : ""}
    ${(m.tool_calls || []).map((c) => html`<${ToolCall} name=${(c.function || {}).name} args=${(c.function || {}).arguments} />`)}
  </div>`;
}

function ToolCall({ name, args, unparsed }) {
  const a = typeof args === "string" ? args : JSON.stringify(args);
  return html`<div class=${`toolcall ${unparsed ? "bad" : ""}`} data-testid="tool-call">⚙ <b>${name || "(unparsed)"}</b>(<code>${a}</code>)</div>`;
}

function Node({ node, index, selected, onSelect, byId }) {
  const [showPrompt, setShowPrompt] = useState(false);
  const kids = node.children.length;
  return html`<div class=${`node ${selected ? "selected" : ""}`} style=${`margin-left:${node.depth * 22}px`} data-testid="node" data-node=${node.id} onClick=${(e) => { e.stopPropagation(); onSelect(node.id); }}>
    <div class="node-head">
      <b>#${index + 1}</b>
      ${node.parent_id && html`<span class="muted">← #${byId[node.parent_id].index + 1}</span>`}
      <${RewardBadge} value=${node.reward} />
      ${node.spliced === true && html`<${Badge} kind="muted" title="its prompt continues the parent's exact tokens">spliced<//>`}
      ${node.spliced === false && html`<${Badge} kind="warn" title="rendered from scratch: the agent changed history">re-rendered<//>`}
      ${kids > 1 && html`<${Badge} kind="branch" title="several completions continue this one">${kids} branches<//>`}
      <span class="muted">stop: ${node.stop_reason} · ${node.prompt_len} prompt + ${node.completion_len} output tokens${node.versions && node.versions.length ? ` · v${node.versions.join("–")}` : ""}</span>
      ${node.failed_tool_calls > 0 && html`<${Badge} kind="bad">${node.failed_tool_calls} failed tool call(s)<//>`}
      ${node.rows.length > 0 && html`<${Badge} kind="tokens" title="token record rows">tokens ›<//>`}
    </div>
    <div class="node-in">
      ${node.messages ? node.messages.map((m) => html`<${Message} m=${m} />`)
        : html`<pre class="text prompt">${node.new_prompt}</pre>`}
      ${node.messages && html`<button class="link small" onClick=${(e) => { e.stopPropagation(); setShowPrompt(!showPrompt); }}>${showPrompt ? "hide" : "show"} the rendered prompt</button>`}
      ${showPrompt && html`<pre class="text prompt">${node.prompt}</pre>`}
    </div>
    <div class="node-out" data-testid="completion">
      <span class="role">assistant</span>
      <pre class="text">${node.completion}</pre>
      ${node.calls.map((c) => html`<${ToolCall} name=${c.name} args=${c.arguments} unparsed=${c.unparsed} />`)}
    </div>
  </div>`;
}

function SessionPage({ run, sid, single }) {
  const { data, error } = useApi("session", { run, id: sid }, [run, sid]);
  const [selected, setSelected] = useState(null);
  const [rowKey, setRowKey] = useState(null);
  const byId = useMemo(() => {
    const out = {};
    if (data) data.nodes.forEach((n, i) => { out[n.id] = { ...n, index: i }; });
    return out;
  }, [data]);
  useEffect(() => {
    if (!data || selected || rowKey) return;
    const first = data.nodes.find((n) => n.rows.length);
    if (first) { setSelected(first.id); setRowKey(first.rows[0]); } else if (data.rows.length) setRowKey(data.rows[0].key);
  }, [data]);
  const select = (id) => { setSelected(id); const n = byId[id]; setRowKey(n && n.rows.length ? n.rows[0] : null); };
  const s = data && data.session;
  const node = selected && byId[selected];
  return html`<div>
    <${Crumbs} run=${run} single=${single} items=${s ? [[`step ${s.step}`, stepHref(run, s.step)], [`session ${sid.slice(0, 18)}`]] : []} />
    <${ErrorBox} error=${error} />
    ${s && html`<div class="kv" data-testid="session-summary">
      <span>task <b>${s.task_id}</b></span><span>group <code>${s.group.slice(0, 16)}</code> member ${fmt(s.traj_index)}</span>
      <span>${s.accepted === false ? html`<b class="bad">rejected: ${s.reason}</b>` : html`<b>accepted</b>`}</span>
      <span>episode reward <b>${typeof data.episode_reward === "object" && data.episode_reward ? "per completion" : fmt(data.episode_reward)}</b></span>
      <span>${data.nodes.length} completion(s)</span><span>version ${fmt(s.version)}</span>
    </div>`}
    ${data && data.error && html`<pre class="error">${data.error}</pre>`}
    ${data && html`<div class="session">
      <div class="tree" data-testid="tree">${data.nodes.map((n, i) => html`<${Node} key=${n.id} node=${n} index=${i} byId=${byId} selected=${n.id === selected} onSelect=${select} />`)}
        ${data.nodes.length === 0 && html`<p class="note">This episode made no model call.</p>`}</div>
      <div class="tokens-pane">
        ${data.rows.some((r) => !r.row_id) && html`<div class="small" data-testid="unlinked-rows">rows not linked to a completion:
          ${data.rows.filter((r) => !r.row_id).map((r) => html`<button class=${`link ${r.key === rowKey ? "on" : ""}`} onClick=${() => { setSelected(null); setRowKey(r.key); }}>${r.key}</button> `)}</div>`}
        ${!node && rowKey && html`<${TokenView} run=${run} sid=${sid} rowKey=${rowKey} />`}
        ${node ? html`<div>
            <h3>Tokens of #${byId[selected].index + 1}</h3>
            ${node.rows.length > 1 && html`<div class="small">rows containing it: ${node.rows.map((k) => html`<button class=${`link ${k === rowKey ? "on" : ""}`} onClick=${() => setRowKey(k)}>${k}</button> `)}</div>`}
            ${rowKey ? html`<${TokenView} run=${run} sid=${sid} rowKey=${rowKey} />`
              : html`<p class="note" data-testid="no-tokens">No token record for this completion (the run did not write one: rollout.dump_to_file off, an older version, or the update has not happened yet).</p>`}
          </div>`
          : !rowKey && html`<p class="note">Select a completion to see its tokens.</p>`}
      </div>
    </div>`}
  </div>`;
}

// ---- tokens -------------------------------------------------------------------------------------

const QUANTITIES = {
  rollout_logprob: "rollout logprob",
  trainer_logprob: "trainer logprob",
  gap: "gap (trainer − rollout)",
  advantage: "advantage",
  loss_mask: "loss mask",
  clipped: "clipped",
};

function quantity(t, q, i) {
  if (q === "loss_mask") return t.loss_mask[i];
  if (q === "clipped") return t.clipped[i];
  if (q === "gap") return t.trainer_logprob[i] === null || t.rollout_logprob[i] === null ? null : t.trainer_logprob[i] - t.rollout_logprob[i];
  return t[q][i];
}

function colour(q, v, scale) {
  if (v === null || v === undefined) return "";
  if (q === "loss_mask") return v ? "rgba(47,111,223,0.22)" : "";
  if (q === "clipped") return v ? "rgba(255,140,0,0.75)" : "rgba(0,160,80,0.12)";
  if (q === "rollout_logprob" || q === "trainer_logprob") {
    const a = Math.min(1, 1 - Math.exp(v)); // improbable tokens are red
    return `rgba(220,40,40,${(0.08 + 0.8 * a).toFixed(3)})`;
  }
  const a = Math.min(1, Math.abs(v) / (scale || 1));
  if (q === "gap") return v >= 0 ? `rgba(220,60,40,${(0.85 * a).toFixed(3)})` : `rgba(40,90,220,${(0.85 * a).toFixed(3)})`;
  return v >= 0 ? `rgba(0,160,80,${(0.1 + 0.75 * a).toFixed(3)})` : `rgba(220,40,40,${(0.1 + 0.75 * a).toFixed(3)})`;
}

function showPiece(p) {
  if (p === null || p === undefined) return "";
  return p.replace(/\n/g, "↵\n").replace(/\t/g, "⇥");
}

function TokenView({ run, sid, rowKey }) {
  const { data, error, loading } = useApi("tokens", { run, session: sid, row: rowKey }, [run, sid, rowKey]);
  const [q, setQ] = useState("rollout_logprob");
  const [pinned, setPinned] = useState(null);
  const [hover, setHover] = useState(null);
  const [wholePrompt, setWholePrompt] = useState(false);
  useEffect(() => { setPinned(null); setHover(null); }, [rowKey]);
  if (error) return html`<${ErrorBox} error=${error} />`;
  if (!data) return html`<p class="muted">${loading ? "loading tokens…" : ""}</p>`;
  const t = data.tokens;
  const n = t.ids.length;
  const firstTrained = t.loss_mask.indexOf(1);
  const keepPrompt = 48;
  const start = wholePrompt || firstTrained < 0 ? 0 : Math.max(0, firstTrained - keepPrompt);
  let scale = 0;
  if (q === "gap" || q === "advantage") for (let i = 0; i < n; i++) { const v = quantity(t, q, i); if (v !== null) scale = Math.max(scale, Math.abs(v)); }
  const shown = pinned !== null ? pinned : hover;
  const r = data.row;
  const cells = [];
  for (let i = start; i < n; i++) {
    const v = quantity(t, q, i);
    cells.push(html`<span class=${`tok ${t.loss_mask[i] ? "trained" : "prompt"} ${pinned === i ? "pinned" : ""}`} data-testid="token" data-i=${i}
      style=${`background:${colour(q, v, scale)}`} onMouseEnter=${() => setHover(i)} onClick=${() => setPinned(pinned === i ? null : i)}>${t.pieces ? showPiece(t.pieces[i]) : `[${t.ids[i]}]`}</span>`);
  }
  const val = (k, d = 5) => (shown === null ? "" : fmt(k === "gap" ? quantity(t, "gap", shown) : t[k][shown], d));
  return html`<div data-testid="token-view">
    <div class="kv small">
      <span>row <code>${r.key}</code></span><span>${r.n} tokens, ${r.k} trained</span><span>reward ${fmt(r.reward)}</span>
      <span>advantage ${fmt(r.adv)}</span><span>clipped ${r.clipped}</span><span>mean |gap| ${fmt(r.gap, 6)}</span>
      <span>clip range ${fmt(data.meta.eps_clip, 2)}/${fmt(data.meta.eps_clip_high, 2)}, ratio against ${data.meta.ratio_against} logprobs</span>
    </div>
    <div class="filters">
      <label>shade by <select value=${q} onChange=${(e) => setQ(e.target.value)} data-testid="quantity">
        ${Object.entries(QUANTITIES).map(([k, label]) => html`<option value=${k}>${label}</option>`)}</select></label>
      ${(q === "gap" || q === "advantage") && html`<span class="small">scale ±${fmt(scale, 5)}</span>`}
      ${start > 0 && html`<button class="link small" data-testid="whole-prompt" onClick=${() => setWholePrompt(true)}>show the whole prompt (${start} more tokens)</button>`}
    </div>
    <div class="inspector" data-testid="inspector">${shown === null ? html`<span class="muted">hover or click a token</span>` : html`
      <span>#<b data-testid="insp-index">${shown}</b></span><span>id <b data-testid="insp-id">${t.ids[shown]}</b></span>
      <span>${JSON.stringify(t.pieces ? t.pieces[shown] : "")}</span>
      <span>${t.loss_mask[shown] ? "trained" : "not trained"}</span>
      <span>rollout <b data-testid="insp-rollout">${val("rollout_logprob")}</b></span>
      <span>trainer <b data-testid="insp-trainer">${val("trainer_logprob")}</b></span>
      <span>gap <b data-testid="insp-gap">${val("gap", 6)}</b></span>
      <span>advantage <b data-testid="insp-adv">${val("advantage", 4)}</b></span>
      <span>clipped <b data-testid="insp-clipped">${t.clipped[shown] === null ? "–" : t.clipped[shown] ? "yes" : "no"}</b></span>
      <span>version ${val("version")}</span>`}</div>
    <div class="tokens" data-testid="tokens" onMouseLeave=${() => setHover(null)}>${cells}</div>
  </div>`;
}

// ---- eval ---------------------------------------------------------------------------------------

function Outcome({ side }) {
  if (!side) return html`<span class="muted">–</span>`;
  return html`<span>${side.success ? html`<b class="good">✓</b>` : html`<b class="bad">✗</b>`} ${fmt(side.reward)}
    ${side.failed_tool_calls ? html` <${Badge} kind="bad">${side.failed_tool_calls} failed call(s)<//>` : ""}
    ${side.accepted === false ? html` <${Badge} kind="bad">${side.reason}<//>` : ""}</span>`;
}

function Reply({ side }) {
  if (!side) return html`<td class="reply muted">not evaluated</td>`;
  return html`<td class="reply"><pre class="text">${side.reply || side.error || ""}</pre>
    ${(side.reply_calls || []).map((c) => html`<${ToolCall} name=${c.name} args=${c.arguments} unparsed=${c.unparsed} />`)}</td>`;
}

function EvalTask({ run, task, before, after }) {
  const { data, error } = useApi("eval", { run, task, before, after }, [run, task, before, after]);
  if (error) return html`<${ErrorBox} error=${error} />`;
  if (!data || !data.items.length) return html`<p class="muted">loading…</p>`;
  const it = data.items[0];
  const col = (side) => (side && side.nodes ? side.nodes.map((n, i) => html`<div class="node">
      <div class="node-head"><b>#${i + 1}</b> <${RewardBadge} value=${n.reward} /> <span class="muted">stop: ${n.stop_reason}</span></div>
      <div class="node-in">${n.messages ? n.messages.map((m) => html`<${Message} m=${m} />`) : html`<pre class="text prompt">${n.new_prompt}</pre>`}</div>
      <div class="node-out"><pre class="text">${n.completion}</pre>${n.calls.map((c) => html`<${ToolCall} name=${c.name} args=${c.arguments} unparsed=${c.unparsed} />`)}</div></div>`)
    : html`<p class="muted">–</p>`);
  return html`<div class="side-by-side" data-testid="eval-detail"><div>${col(it.before)}</div><div>${col(it.after)}</div></div>`;
}

function EvalPage({ run, params, single }) {
  const [offset, setOffset] = useState(0);
  const [open, setOpen] = useState(null);
  const filter = params.filter || "all";
  const { data, error } = useApi("eval", { run, before: params.before, after: params.after, filter, offset, limit: 50 }, [run, params.before, params.after, filter, offset], true);
  const go = (p) => { location.hash = evalHref(run, { before: params.before || "", after: params.after || "", filter, ...p }); setOffset(0); };
  const b = data && data.before;
  const a = data && data.after;
  return html`<div>
    <${Crumbs} run=${run} single=${single} items=${[["held-out evaluation"]]} />
    <h1>Held-out evaluation: before vs after</h1>
    <${ErrorBox} error=${error} />
    ${data && html`<div class="filters">
      <label>before <select value=${b ? b.version : ""} onChange=${(e) => go({ before: e.target.value })} data-testid="before">${data.versions.map((v) => html`<option value=${v}>version ${v}</option>`)}</select></label>
      <label>after <select value=${a ? a.version : ""} onChange=${(e) => go({ after: e.target.value })} data-testid="after">${data.versions.map((v) => html`<option value=${v}>version ${v}</option>`)}</select></label>
    </div>
    <p class="kv" data-testid="eval-summary">
      <span>before: <b>${b ? pct(b.success_rate) : "–"}</b> (version ${b ? b.version : "–"}, step ${b ? fmt(b.step) : "–"})</span>
      <span>after: <b>${pct(a.success_rate)}</b> (version ${a.version}, step ${fmt(a.step)})</span>
      ${data.counts.shared !== undefined && html`<span><b class="good">${data.counts.gained}</b> gained, <b class="bad">${data.counts.lost}</b> lost of ${data.counts.shared}; p = ${data.p_value.toPrecision(2)} (exact McNemar)</span>`}
    </p>
    <div class="filters" data-testid="eval-filters">${["all", "gained", "lost", "changed", "failed_tool_calls", "rejected"].map((f) => html`
      <button class=${f === filter ? "on" : ""} data-filter=${f} onClick=${() => go({ filter: f })}>${f.replace(/_/g, " ")}</button>`)}</div>
    <table class="grid" data-testid="eval-compare">
      <thead><tr><th>problem</th><th>before</th><th>after</th><th>reply before</th><th>reply after</th></tr></thead>
      <tbody>${data.items.map((it) => html`<tr data-testid="eval-row" data-task=${it.task_id} class="clickable" onClick=${() => setOpen(open === it.task_id ? null : it.task_id)}>
        <td>${it.task_id}</td><td><${Outcome} side=${it.before} /></td><td><${Outcome} side=${it.after} /></td>
        <${Reply} side=${it.before} /><${Reply} side=${it.after} /></tr>
        ${open === it.task_id && html`<tr><td colspan="5"><${EvalTask} run=${run} task=${it.task_id} before=${b ? b.version : ""} after=${a.version} /></td></tr>`}`)}</tbody>
    </table>
    ${data.total === 0 && html`<p class="note">No problem matches this filter.</p>`}
    <${Pager} total=${data.total} offset=${offset} limit=${50} onChange=${setOffset} />`}
  </div>`;
}

// ---- app ----------------------------------------------------------------------------------------

function App() {
  const { parts, params } = useRoute();
  const [single, setSingle] = useState(false);
  useEffect(() => { api("runs").then((d) => setSingle(d.runs.length === 1 && d.runs[0].id === "."), () => {}); }, []);
  if (parts[0] !== "r" || parts.length < 2) return html`<${RunsPage} />`;
  const run = parts[1];
  if (parts[2] === "step" && parts[3] !== undefined) return html`<${StepPage} key=${`${run}/${parts[3]}`} run=${run} step=${Number(parts[3])} single=${single} />`;
  if (parts[2] === "session" && parts[3]) return html`<${SessionPage} key=${parts[3]} run=${run} sid=${parts[3]} single=${single} />`;
  if (parts[2] === "eval") return html`<${EvalPage} run=${run} params=${params} single=${single} />`;
  return html`<${OverviewPage} run=${run} single=${single} />`;
}

const root = document.getElementById("app");
root.textContent = ""; // the boot message
render(html`<${App} />`, root);
