// hybridq dashboard: refresh a live page's <main> every few seconds (no framework, no build step).
// The next refresh is scheduled only once the previous answer arrived, so slow pages never pile
// up (a server that is busy answers 503 with Retry-After: wait that long instead).
"use strict";
(function () {
  const main = document.getElementById("main");
  const every = main && Number(main.dataset.refresh);
  if (!every) return;
  async function refresh() {
    let wait = every;
    if (!document.hidden) {
      try {
        const response = await fetch(location.href, { credentials: "same-origin" });
        if (response.ok) {
          const fresh = new DOMParser().parseFromString(await response.text(), "text/html").getElementById("main");
          if (fresh) main.replaceChildren(...fresh.childNodes);
        } else {
          const after = Number(response.headers.get("Retry-After"));
          if (after > 0) wait = Math.max(every, after * 1000);
        }
      } catch (e) {
        /* the server is restarting: try again next time */
      }
    }
    setTimeout(refresh, wait);
  }
  setTimeout(refresh, every);
})();
