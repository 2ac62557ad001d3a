// The console's script: ids copied on a click, confirmations, and live updates from the console's
// Server-Sent Events (the Gateway's WatchRoom / WatchRooms streams). No polling. "Live" only once the
// stream says so (the Gateway confirmed the subscription).
"use strict";
(function () {
  document.addEventListener("click", async (e) => {
    const button = e.target.closest("button.copy");
    if (button) {
      const id = button.dataset.copy;
      try {
        await navigator.clipboard.writeText(id);
        button.textContent = "copied";
        button.classList.add("done");
        setTimeout(() => { button.textContent = button.dataset.was || "id"; button.classList.remove("done"); }, 1500);
      } catch (_) {
        // No clipboard here (plain http, or refused): show the id, selected, to copy by hand.
        const code = document.createElement("code");
        code.className = "id";
        code.textContent = id;
        button.replaceWith(code);
        getSelection().selectAllChildren(code);
      }
      return;
    }
    const confirmed = e.target.closest("[data-confirm]");
    if (confirmed && !window.confirm(confirmed.dataset.confirm)) e.preventDefault();
  });
  for (const b of document.querySelectorAll("button.copy")) b.dataset.was = b.textContent;

  const live = document.getElementById("live");
  if (!live || !window.EventSource) return;
  const state = document.getElementById("live-state");
  const say = (text) => { if (state) state.textContent = text; };
  const source = new EventSource(live.dataset.events);
  const runId = live.dataset.run;
  const refresh = live.dataset.refresh;
  const template = document.createElement("template");
  say("Connecting…");
  source.addEventListener("live", () => say("Live"));
  source.addEventListener("error", () => {
    if (source.readyState === EventSource.CLOSED) say("Live updates stopped (signed out, or too many open pages). Reload to try again.");
    else say("Reconnecting…");
  });
  source.addEventListener("gone", (e) => { source.close(); say(JSON.parse(e.data).message); });
  source.addEventListener("room", (e) => {
    const item = JSON.parse(e.data);
    if (runId) {
      if (item.run_id === runId) { source.close(); location.reload(); }
      return;
    }
    if (item.op === "put") {
      template.innerHTML = item.html.trim();
      const node = template.content.firstElementChild;
      const old = document.getElementById(item.id);
      if (old) old.replaceWith(node);
      else {
        const list = document.getElementById(item.list);
        if (list) { if (item.first) list.prepend(node); else list.appendChild(node); }
      }
    } else if (item.op === "drop") {
      const old = document.getElementById(item.id);
      if (old) old.remove();
    }
  });
  source.addEventListener("changed", async () => {
    if (!refresh) return;
    const got = await fetch(refresh, { credentials: "same-origin" });
    if (got.ok) document.getElementById(live.dataset.target || "approvals").innerHTML = await got.text();
  });
})();
