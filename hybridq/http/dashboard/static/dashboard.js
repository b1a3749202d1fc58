// hybridq dashboard: refresh a live page's <main> every few seconds (no framework, no build step).
"use strict";
(function () {
  const main = document.getElementById("main");
  const every = main && Number(main.dataset.refresh);
  if (!every) return;
  setInterval(async function () {
    if (document.hidden) return;
    try {
      const response = await fetch(location.href, { credentials: "same-origin" });
      if (!response.ok) return;
      const fresh = new DOMParser().parseFromString(await response.text(), "text/html").getElementById("main");
      if (fresh) main.replaceChildren(...fresh.childNodes);
    } catch (e) {
      /* the server is restarting: try again next time */
    }
  }, every);
})();
