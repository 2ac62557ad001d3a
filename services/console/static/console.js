// Live updates from the console's Server-Sent Events (the Gateway's WatchRoom / WatchRooms streams).
// No polling. "Live" only once the stream says so (the Gateway confirmed the subscription).
"use strict";
(function () {
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
    if (item.op === "put") {
      template.innerHTML = item.html.trim();
      const node = template.content.firstElementChild;
      const old = document.getElementById(item.id);
      if (old) old.replaceWith(node);
      else { const list = document.getElementById(item.list); if (list) list.appendChild(node); }
    } else if (item.op === "drop") {
      const old = document.getElementById(item.id);
      if (old) old.remove();
    } else if (item.op === "run") {
      if (runId) { if (item.run_id === runId) { source.close(); location.reload(); } return; }
      const runs = document.getElementById("runs");
      if (!runs || !item.run_id) return;
      let li = document.getElementById("r-" + item.run_id);
      if (!li) {
        li = document.createElement("li");
        li.id = "r-" + item.run_id;
        li.className = "item";
        const a = document.createElement("a");
        a.href = "/runs/" + encodeURIComponent(item.run_id);
        a.textContent = item.run_id.slice(0, 8);
        li.append(a, document.createElement("span"));
        runs.prepend(li);
      }
      li.lastChild.textContent = " " + item.kind.replace("ROOM_EVENT_KIND_", "").toLowerCase().replace("_", " ");
    }
  });
  source.addEventListener("changed", async () => {
    if (!refresh) return;
    const got = await fetch(refresh, { credentials: "same-origin" });
    if (got.ok) document.getElementById("approvals").innerHTML = await got.text();
  });
})();
