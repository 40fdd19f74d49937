//! The web console in a real browser (headless Chromium over WebDriver) against a real
//! two-node cluster on loopback: sign in, the nodes, a sandbox created from the console,
//! its terminal (and its reconnection to the same shell after a dropped socket), an upload,
//! the list updating live as sandboxes come and go, sign-out; a screenshot of every view (`target/console-screenshots/`, and `docs/images/console/`
//! with `AGENTENV_UPDATE_SCREENSHOTS=1`).

use std::path::PathBuf;
use std::time::Duration;

use agentenv_testkit::browser::{Browser, Locator};
use agentenv_testkit::{Wait, target_dir, workspace_root};
use agentenv_tests::{API_KEY, Cluster, api, http, skip_reason};
use serde_json::{Value, json};

/// The screenshots the browser test takes, each shown in docs/console.md.
const SHOTS: &[&str] = &[
    "signin",
    "nodes",
    "sandboxes",
    "sandbox-terminal",
    "files",
    "templates",
    "phone",
];

/// How long one step of the page may take (a sandbox create, a shell start).
const STEP: Duration = Duration::from_secs(60);

/// The browser on one console page, with waits on what the page shows.
struct Page {
    browser: Browser,
    base: String,
    shots: Vec<PathBuf>,
}

impl Page {
    /// Runs `script` (a function body) in the page; its return value.
    async fn js(&self, script: &str, args: Vec<Value>) -> Value {
        self.browser
            .execute(script, args)
            .await
            .unwrap_or_else(|e| panic!("running {script:?} in the page: {e}"))
    }

    /// Runs `script` until it returns something other than `null` or `false`; that value.
    async fn wait_js(&self, what: &str, script: &str, args: Vec<Value>) -> Value {
        Wait::new(what, STEP)
            .every(Duration::from_millis(50))
            .until(|| {
                let args = args.clone();
                async move {
                    match self.browser.execute(script, args).await {
                        Ok(Value::Null) | Ok(Value::Bool(false)) => Err("not yet".to_string()),
                        Ok(v) => Ok(v),
                        Err(e) => Err(e.to_string()),
                    }
                }
            })
            .await
    }

    /// Waits for the element `css` to be shown, and clicks it (found again when the page
    /// replaced it in between, as a live list does).
    async fn click(&self, css: &str) {
        Wait::new(format_args!("{css} to be shown and clicked"), STEP)
            .every(Duration::from_millis(50))
            .until(|| async {
                let el = self
                    .browser
                    .find(Locator::Css(css))
                    .await
                    .map_err(|e| e.to_string())?;
                match el.is_displayed().await {
                    Ok(true) => el.click().await.map_err(|e| e.to_string()),
                    Ok(false) => Err("hidden".to_string()),
                    Err(e) => Err(e.to_string()),
                }
            })
            .await;
    }

    /// Types `keys` into the element `css`.
    async fn type_into(&self, css: &str, keys: &str) {
        let el = self
            .browser
            .find(Locator::Css(css))
            .await
            .unwrap_or_else(|e| panic!("finding {css}: {e}"));
        el.send_keys(keys)
            .await
            .unwrap_or_else(|e| panic!("typing into {css}: {e}"));
    }

    /// Opens the console at `route` (`#/...`).
    async fn open(&self, route: &str) {
        self.js(
            "if (location.hash !== arguments[0]) location.hash = arguments[0]; return true;",
            vec![json!(route)],
        )
        .await;
        self.wait_js(
            &format!("the {route} view"),
            "return location.hash === arguments[0] && !document.getElementById('view').hidden;",
            vec![json!(route)],
        )
        .await;
    }

    /// A screenshot of the viewport as `<name>.png`.
    async fn shot(&mut self, name: &str) {
        assert!(SHOTS.contains(&name), "{name} is listed in SHOTS");
        // Passing notices would cover the view; fonts and layout settle before the picture
        // is taken.
        self.js(
            "document.getElementById('toasts')?.replaceChildren(); return true;",
            vec![],
        )
        .await;
        self.browser
            .execute_async(
                "const done = arguments[arguments.length - 1];\
                 document.fonts.ready.then(() => requestAnimationFrame(() => \
                 requestAnimationFrame(() => done(true))));",
                vec![],
            )
            .await
            .expect("waiting for a frame");
        let path = target_dir()
            .join("console-screenshots")
            .join(format!("{name}.png"));
        self.browser
            .save_screenshot(&path)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        if std::env::var("AGENTENV_UPDATE_SCREENSHOTS").is_ok_and(|v| v == "1") {
            let docs = workspace_root()
                .join("docs/images/console")
                .join(format!("{name}.png"));
            std::fs::create_dir_all(docs.parent().unwrap()).expect("docs/images/console");
            std::fs::copy(&path, &docs).expect("copying the screenshot into docs");
        }
        self.shots.push(path);
    }
}

/// The status of `GET /console/api/session` fetched by the page (its cookies, same origin).
async fn session_status_from_page(page: &Page) -> Value {
    page.browser
        .execute_async(
            "const done = arguments[arguments.length - 1];\
             fetch('/console/api/session', {credentials: 'same-origin'})\
               .then(r => done(r.status), e => done(String(e)));",
            vec![],
        )
        .await
        .expect("fetching the session from the page")
}

/// The status of `GET /console/api/session` sent by the test with `cookie`.
async fn session_status_with_cookie(gateway: std::net::SocketAddr, cookie: String) -> u16 {
    tokio::task::spawn_blocking(move || {
        http(
            gateway,
            "GET",
            "/console/api/session",
            &[("cookie", &cookie)],
            "",
        )
        .0
    })
    .await
    .expect("session request")
}

#[test]
fn every_screenshot_is_committed_and_shown_in_the_console_doc() {
    let doc =
        std::fs::read_to_string(workspace_root().join("docs/console.md")).expect("docs/console.md");
    for name in SHOTS {
        let rel = format!("images/console/{name}.png");
        assert!(
            doc.contains(&format!("]({rel})")),
            "docs/console.md shows {rel}"
        );
        let png = std::fs::read(workspace_root().join("docs").join(&rel))
            .unwrap_or_else(|e| panic!("docs/{rel}: {e} (AGENTENV_UPDATE_SCREENSHOTS=1 takes it)"));
        assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"), "docs/{rel} is a PNG");
    }
}

#[test]
fn console_in_a_browser_signs_in_runs_a_terminal_uploads_kills_live_and_signs_out() {
    if let Some(r) = skip_reason().or_else(agentenv_testkit::browser::skip_reason) {
        eprintln!("SKIPPED: {r}");
        return;
    }
    let cluster = Cluster::start(2, 32);
    cluster.wait_nodes_listed(2);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let browser = Browser::start().await.expect("starting the browser");
        let mut page = Page {
            browser,
            base: format!("http://{}/console/", cluster.gateway),
            shots: Vec::new(),
        };
        let run = std::panic::AssertUnwindSafe(drive(&cluster, &mut page));
        if let Err(panic) = futures::FutureExt::catch_unwind(run).await {
            // What the page showed when a step failed, for whoever reads the failure.
            let path = target_dir().join("console-screenshots/failure.png");
            if page.browser.save_screenshot(&path).await.is_ok() {
                eprintln!("the page at the failure: {}", path.display());
            }
            if let Ok(text) = page
                .browser
                .execute("return document.body.innerText;", vec![])
                .await
            {
                eprintln!(
                    "the page's text at the failure:\n{}",
                    text.as_str().unwrap_or_default()
                );
            }
            std::panic::resume_unwind(panic);
        }
        page.browser.close().await;
    });
}

async fn drive(cluster: &Cluster, page: &mut Page) {
    page.browser
        .goto(&page.base)
        .await
        .expect("loading /console/");

    // Signing in: the page asks for the key and keeps it nowhere.
    page.wait_js(
        "the sign-in view",
        "return !document.getElementById('signin-view').hidden;",
        vec![],
    )
    .await;
    page.shot("signin").await;
    page.type_into("[data-testid=signin-key]", API_KEY).await;
    page.click("[data-testid=signin-submit]").await;

    // The nodes view lists both nodes of the cluster.
    let nodes = page
        .wait_js(
            "both nodes in the nodes view",
            "const rows = [...document.querySelectorAll('[data-testid=nodes-table] tr[data-node-id]')];\
             const ids = rows.map(r => r.dataset.nodeId).sort();\
             return ids.length === 2 ? ids : null;",
            vec![],
        )
        .await;
    assert_eq!(nodes, json!(["node-32", "node-33"]));
    let stored = page
        .js(
            "return JSON.stringify([Object.entries(localStorage), Object.entries(sessionStorage), \
             document.getElementById('signin-key').value]);",
            vec![],
        )
        .await;
    assert!(
        !stored.as_str().unwrap_or_default().contains(API_KEY),
        "the API key is kept in no storage and the field is cleared: {stored}"
    );

    // A sandbox created from the console appears in the live list.
    page.open("#/sandboxes").await;
    page.click("[data-testid=create-open]").await;
    page.wait_js(
        "template base in the create dialog",
        "return !!document.querySelector('[data-testid=create-template] option[value=base]');",
        vec![],
    )
    .await;
    page.browser
        .find(Locator::Css("[data-testid=create-template]"))
        .await
        .expect("the template select")
        .select_by_value("base")
        .await
        .expect("choosing template base");
    page.type_into("#create-metadata", "purpose=console-docs")
        .await;
    page.click("[data-testid=create-submit]").await;
    let id = page
        .wait_js(
            "the created sandbox (its page or its row)",
            "const m = location.hash.match(/^#\\/sandboxes\\/(.+)$/);\
             if (m) return decodeURIComponent(m[1]);\
             const r = document.querySelector('[data-testid=sandboxes-table] tr[data-sandbox-id]');\
             return r ? r.dataset.sandboxId : null;",
            vec![],
        )
        .await;
    let id = id.as_str().expect("sandbox id").to_string();
    page.open("#/sandboxes").await;
    let row = format!("[data-testid=sandboxes-table] tr[data-sandbox-id=\"{id}\"]");
    page.wait_js(
        "the sandbox's row, running",
        "const r = document.querySelector(arguments[0]);\
         return !!r && r.dataset.state === 'running';",
        vec![json!(row)],
    )
    .await;

    // A sandbox created elsewhere (the API, as an SDK would) is pushed into the open list.
    page.js("window.__sameConsolePage = true; return true;", vec![])
        .await;
    let other = tokio::task::block_in_place(|| {
        cluster.create(r#"{"templateID":"base","timeout":300,"metadata":{"via":"sdk"}}"#)
    });
    let other_row = format!("[data-testid=sandboxes-table] tr[data-sandbox-id=\"{other}\"]");
    page.wait_js(
        "the sandbox created through the API in the open list",
        "return !!document.querySelector(arguments[0]);",
        vec![json!(other_row)],
    )
    .await;
    page.shot("sandboxes").await;

    // The nodes view counts them, pushed as the nodes' heartbeats report them.
    page.open("#/nodes").await;
    page.wait_js(
        "the nodes view to count both sandboxes",
        "const rows = [...document.querySelectorAll('[data-testid=nodes-table] tr[data-node-id]')];\
         return rows.reduce((n, r) => n + parseInt(r.children[2].textContent, 10), 0) === 2;",
        vec![],
    )
    .await;
    page.shot("nodes").await;
    page.open("#/sandboxes").await;

    // Its terminal: a shell in the sandbox answers a command typed into xterm.js. The
    // page's WebSockets are kept track of, so that the terminal's can be dropped later.
    page.js(
        "if (!window.__sockets) {\
           window.__sockets = [];\
           const Plain = window.WebSocket;\
           window.WebSocket = class extends Plain {\
             constructor(...args) { super(...args); window.__sockets.push(this); }\
           };\
         }\
         return true;",
        vec![],
    )
    .await;
    page.click(&format!("{row} a[href^='#/sandboxes/']")).await;
    let term_text = "const rows = document.querySelector('[data-testid=terminal] .xterm-rows');\
                     return rows ? rows.innerText.replace(/\\u00a0/g, ' ') : null;";
    page.wait_js(
        "the shell's prompt in the terminal",
        &format!("const t = (() => {{ {term_text} }})(); return !!t && t.trim().length > 0;"),
        vec![],
    )
    .await;
    page.click("[data-testid=terminal] .xterm-screen").await;
    page.type_into(
        "[data-testid=terminal] textarea.xterm-helper-textarea",
        "echo console-$((6*7))\u{e007}",
    )
    .await;
    let shown = page
        .wait_js(
            "console-42 printed by the shell",
            &format!(
                "const t = (() => {{ {term_text} }})(); \
                 return t && /^console-42\\s*$/m.test(t) ? t : null;"
            ),
            vec![],
        )
        .await;
    assert!(
        shown
            .as_str()
            .unwrap_or_default()
            .contains("console-$((6*7))"),
        "the typed command is echoed: {shown}"
    );
    page.shot("sandbox-terminal").await;

    // A dropped terminal socket (a network blip) reconnects to the same shell: what the
    // shell was told before is still there.
    page.type_into(
        "[data-testid=terminal] textarea.xterm-helper-textarea",
        "KEPT=kept-$((2*21))\u{e007}",
    )
    .await;
    page.wait_js(
        "the shell to take the assignment (a new prompt after it)",
        &format!(
            "const t = (() => {{ {term_text} }})(); \
             return !!t && /KEPT=kept-\\$\\(\\(2\\*21\\)\\)\\s*\\n.*[#$]$/.test(t.trimEnd());"
        ),
        vec![],
    )
    .await;
    let dropped = page
        .js(
            "const open = window.__sockets.filter(s => s.url.includes('/terminal') \
               && s.readyState === WebSocket.OPEN);\
             open.forEach(s => s.close());\
             return open.length;",
            vec![],
        )
        .await;
    assert_eq!(dropped, json!(1), "one open terminal socket to drop");
    page.wait_js(
        "the terminal to reconnect to the same shell",
        "const s = document.getElementById('terminal-status');\
         return !!s && s.textContent.includes('connected again');",
        vec![],
    )
    .await;
    page.type_into(
        "[data-testid=terminal] textarea.xterm-helper-textarea",
        "echo $KEPT\u{e007}",
    )
    .await;
    page.wait_js(
        "the shell's variable read back after the reconnect",
        &format!(
            "const t = (() => {{ {term_text} }})(); \
             return !!t && /^kept-42\\s*$/m.test(t);"
        ),
        vec![],
    )
    .await;

    // Files: an upload through the file input shows in the list and reads back.
    let upload_dir = tempfile::tempdir().expect("temp dir");
    let local = upload_dir.path().join("console-upload.txt");
    std::fs::write(&local, "uploaded from the console\n").expect("writing the upload");
    page.wait_js(
        "the file list",
        "return !!document.querySelector('[data-testid=files-list]');",
        vec![],
    )
    .await;
    page.type_into(
        "[data-testid=files-upload]",
        local.to_str().expect("utf-8 path"),
    )
    .await;
    let uploaded = page
        .wait_js(
            "console-upload.txt in the file list",
            "const r = document.querySelector('[data-testid=files-list] tr[data-path$=\"/console-upload.txt\"]');\
             return r ? r.dataset.path : null;",
            vec![],
        )
        .await;
    let content = page
        .browser
        .execute_async(
            "const done = arguments[arguments.length - 1];\
             fetch(arguments[0], {credentials: 'same-origin'})\
               .then(r => r.text()).then(done, e => done(String(e)));",
            vec![json!(format!(
                "/console/api/sandboxes/{id}/file?path={}",
                uploaded.as_str().unwrap_or_default()
            ))],
        )
        .await
        .expect("downloading the upload");
    assert_eq!(content, json!("uploaded from the console\n"));
    page.js(
        "document.getElementById('files-h').closest('section')\
         .scrollIntoView({block: 'center'}); return true;",
        vec![],
    )
    .await;
    page.shot("files").await;

    // Templates and snapshots.
    page.open("#/templates").await;
    page.wait_js(
        "template base in the templates view",
        "return !!document.querySelector('tr[data-template-id=base]');",
        vec![],
    )
    .await;
    page.shot("templates").await;

    // A phone-sized window renders the sandbox list.
    page.open("#/sandboxes").await;
    page.browser
        .set_viewport_size(390, 844)
        .await
        .expect("a phone-sized viewport");
    page.wait_js(
        "the sandbox's row on the phone",
        "return !!document.querySelector(arguments[0]);",
        vec![json!(row)],
    )
    .await;
    page.shot("phone").await;
    page.browser
        .set_viewport_size(1280, 860)
        .await
        .expect("the laptop-sized viewport again");

    // Killing one from the list and the other through the API: both rows go, without a
    // reload of the page.
    page.click(&format!("{row} [data-testid=sandbox-kill]"))
        .await;
    page.click("[data-testid=confirm-yes]").await;
    page.wait_js(
        "the killed sandbox's row to go",
        "return !document.querySelector(arguments[0]);",
        vec![json!(row)],
    )
    .await;
    let (st, v) = tokio::task::block_in_place(|| {
        api(
            cluster.gateway,
            "DELETE",
            &format!("/sandboxes/{other}"),
            "",
        )
    });
    assert_eq!(st, 204, "killing {other} through the API: {v}");
    page.wait_js(
        "the row of the sandbox killed through the API to go",
        "return !document.querySelector(arguments[0]);",
        vec![json!(other_row)],
    )
    .await;
    assert_eq!(
        page.js("return window.__sameConsolePage === true;", vec![])
            .await,
        json!(true),
        "the list updated without a reload"
    );

    // Signing out: the session is gone for the page and for whoever kept its cookie.
    let cookie = page
        .browser
        .get_all_cookies()
        .await
        .expect("cookies")
        .into_iter()
        .find(|c| c.name() == "agentenv_console")
        .map(|c| format!("agentenv_console={}", c.value()))
        .expect("the session cookie");
    assert_eq!(
        session_status_with_cookie(cluster.gateway, cookie.clone()).await,
        200,
        "the session works before signing out"
    );
    page.click("[data-testid=signout]").await;
    page.wait_js(
        "the sign-in view after signing out",
        "return !document.getElementById('signin-view').hidden;",
        vec![],
    )
    .await;
    assert_eq!(session_status_from_page(page).await, json!(401));
    assert_eq!(
        session_status_with_cookie(cluster.gateway, cookie).await,
        401,
        "the old cookie no longer works"
    );

    for shot in &page.shots {
        eprintln!("screenshot: {}", shot.display());
    }
}
