# ruff: noqa: E501  (the inline JavaScript keeps its own line lengths)
"""The viewer page's inline stylesheet and script (no network: everything is in the one file).

The script reads the episodes from ``<script id="data" type="application/json">`` and the initial
state from the URL fragment: ``#benchmark=B&step=S&finish=F&rmin=X&rmax=Y&overlay=O&open=N|all``
(``overlay``: ``none`` | ``mask`` | ``advantage`` | ``ratio`` | ``masked``), so a browser with no
interaction (``chromium --headless --dump-dom``) can be checked too. A coloured token carries
``data-hl`` (its overlay class: ``on``/``off`` for the loss mask, ``pos``/``neg`` for the sign of
the advantage and of log ρ, ``masked``/``clipped``).

Every value of an episode the script puts into HTML goes through ``esc`` (``&``, ``<``, ``>``,
``"``), numbers and counts included: a crafted run folder's fields are text, never markup.
"""

CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,sans-serif;margin:0;color:#1f2328;background:#f6f8fa}
header{position:sticky;top:0;z-index:2;background:#fff;border-bottom:1px solid #d0d7de;padding:8px 14px;
 display:flex;flex-wrap:wrap;gap:10px;align-items:center}
header h1{font-size:16px;margin:0 12px 0 0}
header label{font-size:12px;color:#57606a}
header select,header input{font-size:13px;margin-left:3px}
header input[type=number]{width:64px}
#count{font-weight:600;margin-left:auto}
main{padding:10px 14px}
details.episode{background:#fff;border:1px solid #d0d7de;border-radius:6px;margin:0 0 8px}
details.episode>summary{cursor:pointer;padding:6px 10px;font-size:13px;display:flex;gap:12px;flex-wrap:wrap}
summary .bench{font-weight:600}
summary .rw{font-family:ui-monospace,monospace}
summary .rw.good{color:#1a7f37} summary .rw.bad{color:#cf222e}
summary .meta{color:#57606a}
.answer{margin:6px 0;padding:4px 8px;background:#fff8c5;border-left:4px solid #d4a72c}
.body{padding:4px 10px 10px;border-top:1px solid #eaeef2}
.prompt{white-space:pre-wrap;background:#f6f8fa;border-left:4px solid #8c959f;padding:6px 8px;margin:6px 0;
 font-size:12px;max-height:160px;overflow:auto}
.turn{white-space:pre-wrap;font-family:ui-monospace,SFMono-Regular,Menlo,monospace;font-size:12px;
 padding:6px 8px;margin:6px 0;border-radius:4px}
.turn.model{background:#ddf4ff;border-left:4px solid #0969da}
.turn.tool-out{background:#fff8c5;border-left:4px solid #9a6700}
.turn .role{display:block;font:600 11px system-ui,sans-serif;color:#57606a;margin-bottom:2px}
.call{background:#fbefff;outline:1px solid #8250df;border-radius:3px}
.tok[data-hl=on]{background:rgba(46,160,67,.35)} .tok[data-hl=off]{background:rgba(140,149,159,.3)}
.tok[data-hl=masked]{background:rgba(207,34,46,.55);text-decoration:line-through}
.tok[data-hl=clipped]{background:rgba(251,143,68,.6)}
.legend{font-size:12px;color:#57606a}
.legend span{padding:0 4px;border-radius:3px}
"""

JS = r"""
(function(){
const D = JSON.parse(document.getElementById('data').textContent);
const EPS = D.episodes;
const $ = id => document.getElementById(id);
const CALL_RE = /<(code|search|tool_call|python)>[\s\S]*?(<\/\1>|$)/g;
function esc(s){return String(s).replace(/[&<>"]/g, c => ({'&':'&amp;','<':'&lt;','>':'&gt;','"':'&quot;'}[c]));}
function hash(){const h = {}; location.hash.replace(/^#/, '').split('&').forEach(kv => {
  if(!kv) return; const i = kv.indexOf('='); h[decodeURIComponent(kv.slice(0, i < 0 ? kv.length : i))] =
  i < 0 ? '' : decodeURIComponent(kv.slice(i + 1));}); return h;}
function fill(sel, values){values.forEach(v => {const o = document.createElement('option');
  o.value = v; o.textContent = v; sel.appendChild(o);});}
function uniq(f){return [...new Set(EPS.map(f))];}
fill($('f-benchmark'), uniq(e => e.benchmark).sort());
fill($('f-step'), uniq(e => e.step === null ? 'eval' : String(e.step)).sort((a, b) =>
  (a === 'eval') - (b === 'eval') || Number(a) - Number(b)));
fill($('f-finish'), uniq(e => e.finish).sort());
function withCalls(text){text = String(text); let out = '', last = 0; text.replace(CALL_RE, (m, _t, _c, off) => {
  out += esc(text.slice(last, off)) + '<span class="call">' + esc(m) + '</span>'; last = off + m.length; return m;});
  return out + esc(text.slice(last));}
function tokensHtml(ep){let html = '', i = 0; const T = ep.tokens;
  while(i < T.length){let j = i; while(j < T.length && T[j].m === T[i].m) j++;
    const model = T[i].m === 1;
    html += '<div class="turn ' + (model ? 'model' : 'tool-out') + '"><span class="role">' +
      (model ? 'model' : 'tool output') + '</span>';
    for(let k = i; k < j; k++){html += '<span class="tok' + (T[k].c ? ' call' : '') + '" data-i="' + k + '">' +
      esc(T[k].t) + '</span>';}
    html += '</div>'; i = j;}
  return html;}
function turnsHtml(ep){return ep.turns.map(t => (t.action ? '<div class="turn model"><span class="role">model' +
  '</span>' + withCalls(t.action) + '</div>' : '') + (t.observation ? '<div class="turn tool-out"><span class="role">' +
  'tool output</span>' + esc(t.observation) + '</div>' : '')).join('');}
function render(det){if(det.dataset.done) return; const ep = EPS[Number(det.dataset.k)];
  let html = '<div class="body"><div class="prompt">' + esc(ep.prompt) + '</div>';
  html += ep.tokens ? tokensHtml(ep) : turnsHtml(ep);
  if(ep.gold !== undefined && ep.gold !== null) html += '<div class="answer">answer <b>' +
    esc(ep.answer === null || ep.answer === undefined ? '(none)' : String(ep.answer)) + '</b> · gold <b>' +
    esc(Array.isArray(ep.gold) ? ep.gold.join(' | ') : String(ep.gold)) + '</b>' +
    (ep.correct === undefined || ep.correct === null ? '' : (ep.correct ? ' · correct' : ' · wrong')) + '</div>';
  if(ep.cut_tokens) html += '<div class="legend">cut to ' + esc(ep.tokens.length) + ' of ' + esc(ep.cut_tokens) + ' tokens</div>';
  det.insertAdjacentHTML('beforeend', html + '</div>'); det.dataset.done = '1'; paint(det);}
function paint(det){const ep = EPS[Number(det.dataset.k)]; if(!ep.tokens || !det.dataset.done) return;
  const mode = document.body.dataset.overlay; const pi = ep.policy_interval, ai = ep.advantage_interval;
  let amax = 1e-9; ep.tokens.forEach(t => {if(t.m && t.a !== null) amax = Math.max(amax, Math.abs(t.a));});
  det.querySelectorAll('.tok').forEach(s => {const t = ep.tokens[Number(s.dataset.i)];
    s.removeAttribute('data-hl'); s.style.background = ''; s.title = '';
    if(mode === 'none') return;
    s.title = 'mask ' + t.m + (t.m ? '  A ' + t.a + '  ρ ' + t.r : '');
    if(mode === 'mask'){s.dataset.hl = t.m ? 'on' : 'off'; return;}
    if(!t.m || t.a === null || t.r === null) return;
    if(mode === 'advantage'){const a = t.a / amax; s.dataset.hl = a >= 0 ? 'pos' : 'neg';
      s.style.background = (a >= 0 ? 'rgba(46,160,67,' : 'rgba(207,34,46,') + (0.1 + 0.7 * Math.abs(a)).toFixed(3) + ')';}
    else if(mode === 'ratio'){const lr = Math.log(t.r); s.dataset.hl = lr >= 0 ? 'pos' : 'neg';
      s.style.background = (lr >= 0 ? 'rgba(207,34,46,' : 'rgba(9,105,218,') +
        (0.08 + 0.8 * Math.min(1, Math.abs(lr) / 0.5)).toFixed(3) + ')';}
    else if(mode === 'masked'){if(pi && (t.r <= pi[0] || t.r >= pi[1])) s.dataset.hl = 'masked';
      else if(ai && (t.r < ai[0] || t.r > ai[1])) s.dataset.hl = 'clipped';}
  });}
function apply(){const b = $('f-benchmark').value, st = $('f-step').value, f = $('f-finish').value;
  const lo = $('f-rmin').value === '' ? -Infinity : Number($('f-rmin').value);
  const hi = $('f-rmax').value === '' ? Infinity : Number($('f-rmax').value);
  let n = 0;
  document.querySelectorAll('details.episode').forEach(det => {const e = EPS[Number(det.dataset.k)];
    const ok = (!b || e.benchmark === b) && (!st || (e.step === null ? 'eval' : String(e.step)) === st) &&
      (!f || e.finish === f) && e.reward >= lo && e.reward <= hi;
    det.hidden = !ok; if(ok) n++;});
  $('count').textContent = n + ' of ' + EPS.length + ' episodes'; $('count').dataset.visible = n;}
function setOverlay(mode){document.body.dataset.overlay = mode; $('f-overlay').value = mode;
  document.querySelectorAll('details.episode').forEach(paint);}
const main = $('episodes');
main.innerHTML = EPS.map((e, k) => '<details class="episode" data-k="' + k + '"><summary><span class="bench">' +
  esc(e.benchmark) + '</span><span>' + (e.step === null ? esc(e.source) : 'step ' + esc(e.step)) + '</span>' +
  '<span class="rw ' + (e.reward > 0.5 ? 'good' : 'bad') + '">reward ' + esc(Number(e.reward).toFixed(3)) + '</span><span>' +
  esc(e.finish_reason || '') + '</span><span class="meta">' + esc(e.sample_id === undefined ? '' : 'id ' + e.sample_id) +
  ' ' + Object.entries(e.meta || {}).map(([k, v]) => esc(k) + ' ' + esc(Number.isInteger(v) ? v : Number(v).toPrecision(3))).join(' · ') + '</span></summary></details>').join('');
main.querySelectorAll('details.episode').forEach(det => det.addEventListener('toggle', () => render(det)));
['f-benchmark', 'f-step', 'f-finish', 'f-rmin', 'f-rmax'].forEach(id => $(id).addEventListener('input', apply));
$('f-overlay').addEventListener('input', () => setOverlay($('f-overlay').value));
const h = hash();
[['benchmark', 'f-benchmark'], ['step', 'f-step'], ['finish', 'f-finish'], ['rmin', 'f-rmin'], ['rmax', 'f-rmax']]
  .forEach(([k, id]) => {if(h[k] !== undefined) $(id).value = h[k];});
apply();
const visible = [...document.querySelectorAll('details.episode')].filter(d => !d.hidden);
const nOpen = h.open === 'all' ? visible.length : (h.open === undefined ? 3 : Number(h.open));
visible.slice(0, nOpen).forEach(d => {d.open = true; render(d);});
setOverlay(h.overlay || (EPS.some(e => e.tokens) ? 'mask' : 'none'));
document.body.dataset.ready = '1';
})();
"""
