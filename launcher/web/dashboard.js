// lmlaunch dashboard: the runs table as `status` shows it and the selected run's curves, attempts,
// per-rank compute, evaluation scores (eval.alongside) and notes, refreshed every 2 s without reloading. Read-only: GET requests only.
"use strict";

const TOKEN = new URLSearchParams(window.location.search).get("token") || "";
const EVERY_MS = 2000;
let selected = new URLSearchParams(window.location.search).get("run");
let refreshes = 0;

function api(path) {
  const sep = path.includes("?") ? "&" : "?";
  return fetch(`${path}${sep}token=${encodeURIComponent(TOKEN)}`, { cache: "no-store" }).then((r) => {
    if (!r.ok) throw new Error(`${path}: HTTP ${r.status}`);
    return r.json();
  });
}

function text(v, digits) {
  if (v === null || v === undefined) return "–";
  return typeof v === "number" && digits !== undefined ? v.toFixed(digits) : String(v);
}

function cell(row, value, cls) {
  const td = document.createElement("td");
  td.textContent = value;
  if (cls) td.className = cls;
  row.appendChild(td);
}

function drawRuns(rows) {
  const body = document.querySelector("#runs tbody");
  body.replaceChildren();
  if (!selected && rows.length) selected = (rows.find((r) => r.group === "running") || rows[0]).name;
  const several = new Set(rows.map((r) => r.cluster)).size > 1;  // runs on several clusters: each job says where
  for (const r of rows) {
    const tr = document.createElement("tr");
    tr.className = "run" + (r.name === selected ? " selected" : "");
    tr.dataset.run = r.name;
    cell(tr, r.name);
    cell(tr, text(r.job_id) + (several && r.job_id ? `@${r.cluster}` : ""));
    cell(tr, r.state, r.group);
    cell(tr, text(r.attempt));
    cell(tr, `${text(r.step)}/${text(r.max_steps)}`);
    cell(tr, text(r.loss, 3));
    cell(tr, r.tokens_per_s === null ? "–" : Math.round(r.tokens_per_s).toLocaleString());
    cell(tr, text(r.checkpoint_step));
    cell(tr, r.note || "", "note");
    tr.addEventListener("click", () => { selected = r.name; drawRuns(rows); });
    body.appendChild(tr);
  }
}

function explain(canvasId, noteId, why) {
  document.getElementById(canvasId).style.display = why ? "none" : "";
  document.getElementById(noteId).textContent = why;
}

function lineChart(id, label, color) {
  return new Chart(document.getElementById(id), {
    type: "line",
    data: { datasets: [{ label, data: [], borderColor: color, pointRadius: 0, borderWidth: 1.5 }] },
    options: { animation: false, parsing: false, scales: { x: { type: "linear", title: { display: true, text: "step" } } } },
  });
}

const charts = {
  loss: lineChart("loss-chart", "training loss", "#2f6fdb"),  // and the validation loss beside it (drawRun)
  speed: lineChart("speed-chart", "tokens/s", "#0a7a2f"),
  // one line per lm-eval task and metric over the checkpoints' steps; a log scale holds accuracies and perplexities
  eval: new Chart(document.getElementById("eval-chart"), {
    type: "line",
    data: { datasets: [] },
    options: { animation: false, parsing: false, plugins: { title: { display: true, text: "evaluation (eval.alongside)" } },
      scales: { x: { type: "linear", title: { display: true, text: "checkpoint step" } }, y: { type: "logarithmic" } } },
  }),
  ranks: new Chart(document.getElementById("rank-chart"), {
    type: "bar",
    data: { labels: [], datasets: [{ label: "forward s/step by rank", data: [], backgroundColor: [] }] },
    options: { animation: false },
  }),
};

function drawRun(run) {
  document.getElementById("run-title").textContent =
    `${run.name}: attempt ${text(run.attempt)}, step ${text(run.step)} of ${text(run.max_steps)}`;
  charts.loss.data.datasets[0].data = run.steps.filter((s) => s.loss !== null).map((s) => ({ x: s.step, y: s.loss }));
  const val = (run.val || []).filter((v) => typeof v.val_loss === "number").map((v) => ({ x: v.step, y: v.val_loss }));
  charts.loss.data.datasets = [charts.loss.data.datasets[0]].concat(val.length ? [{ label: "validation loss", data: val,
    borderColor: "#e6550d", pointRadius: 3, borderWidth: 1.5, showLine: true }] : []);
  document.body.dataset.lossSeries = charts.loss.data.datasets.map((d) => d.label).join(",");  // what a test reads
  charts.speed.data.datasets[0].data = run.steps.filter((s) => s.tokens_per_s !== null)
    .map((s) => ({ x: s.step, y: s.tokens_per_s }));
  const ranks = run.ranks || [];
  charts.ranks.data.labels = ranks.map((r) => `rank ${r.rank} (${r.node})`);
  charts.ranks.data.datasets[0].data = ranks.map((r) => r.forward);
  charts.ranks.data.datasets[0].backgroundColor = ranks.map((r) => (r.slow ? "#b3261e" : "#7a8fb0"));
  // an empty chart says why instead of drawing empty axes
  explain("rank-chart", "rank-empty", ranks.length ? "" : (run.group === "running"
    ? "per-rank timing: not reported yet by this attempt" : `per-rank timing is shown while an attempt runs (this run is ${run.state})`));
  const palette = ["#6a3d9a", "#e6550d", "#31a354", "#3182bd", "#de2d26", "#756bb1", "#636363"];
  const series = new Map();
  for (const e of run.eval || []) {
    const key = `${e.task}/${e.metric}`;
    if (!series.has(key)) series.set(key, []);
    if (typeof e.value === "number" && e.value > 0) series.get(key).push({ x: e.step, y: e.value });
  }
  charts.eval.data.datasets = [...series.entries()].map(([label, data], i) => (
    { label, data, borderColor: palette[i % palette.length], pointRadius: 3, borderWidth: 1.5 }));
  explain("eval-chart", "eval-empty", series.size ? "" : (run.eval_alongside === false
    ? "no evaluator runs alongside this run (eval.alongside in its spec)" : "no checkpoint of this run has been scored yet"));
  // the scored steps this page has drawn (what a reader or a test sees)
  document.body.dataset.evalSteps = [...new Set((run.eval || []).map((e) => e.step))].join(",");
  for (const c of Object.values(charts)) c.update("none");
  const attempts = document.getElementById("attempts");
  attempts.replaceChildren(...run.attempts.map((a) => {
    const li = document.createElement("li");
    li.textContent = `attempt ${a.attempt} (job ${a.job_id}${a.cluster ? " on " + a.cluster : ""}): steps ${text(a.start_step)} → ${text(a.end_step)}, ` +
      `${a.reason || "running"}${a.requeued ? ", requeued" : ""}` +
      (a.gpu_hours != null ? `, ${gpuHours(a.gpu_hours)} GPU-hours (${a.gpus} GPUs)` : "");
    return li;
  }));
  // goodput in GPU-hours, where accounting says what the attempts held (sacct's AllocTRES)
  document.getElementById("gpu-hours").textContent = run.gpu_hours != null
    ? `GPU-hours: ${gpuHours(run.gpu_hours)} held, ${gpuHours(run.train_gpu_hours)} of them training` : "";
  // the steps this page has shown, newest last (what a reader or a test sees change between refreshes)
  const seen = (document.body.dataset.steps ? document.body.dataset.steps.split(",") : []).concat(String(run.step));
  document.body.dataset.steps = seen.slice(-20).join(",");
  const notes = document.getElementById("notes");
  notes.replaceChildren(...run.notes.map((n) => { const li = document.createElement("li"); li.textContent = n; return li; }));
}

function gpuHours(h) {
  return h == null ? "-" : h >= 0.1 ? h.toFixed(2) : h.toFixed(4);
}

async function refresh() {
  try {
    const runs = await api("api/runs");
    if (selected && !runs.runs.some((r) => r.name === selected)) selected = null; // a run gone from the registry
    drawRuns(runs.runs);
    const asked = selected;
    const run = asked ? await api(`api/run/${encodeURIComponent(asked)}`) : null;
    if (run && asked === selected) drawRun(run); // not a late answer for a run no longer selected
    refreshes += 1;
    const read = runs.time ? new Date(runs.time * 1000).toLocaleTimeString() : "–";
    document.getElementById("updated").textContent =
      `runs read at ${read} (refresh ${refreshes}; SLURM ${runs.slurm_reachable ? "answers" : "does not answer"})`;
    document.getElementById("error").textContent = "";
  } catch (err) {
    document.getElementById("error").textContent = `could not refresh: ${err.message}`;
  }
}

// the next refresh once this one is done: a slow server is never asked twice at once
async function loop() {
  await refresh();
  setTimeout(loop, EVERY_MS);
}
loop();
