//! The web UI in a real headless browser (Debian's chromium, driven through chromedriver
//! with WebDriver): the numbers it shows are the API's, the watermark moves while the job
//! runs, a deploy through its form swaps the plugin, and text from outside (a key, a
//! plugin's output) is shown as text.

mod common;
use common::*;

use fantoccini::{Client, ClientBuilder, Locator};
use km0::control::client::{call, send};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// chromedriver on a free port; when dropped (a failed test included) it is asked to shut
/// down, which ends the browsers it started, then killed.
struct Driver(Child, u16);

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = call(&format!("http://127.0.0.1:{}", self.1), "GET", "/shutdown", None);
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn chromedriver() -> Driver {
    let bin = std::env::var("KM0_CHROMEDRIVER").unwrap_or_else(|_| "chromedriver".into());
    let port = free_port();
    let child = Command::new(&bin)
        .arg(format!("--port={port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| {
            panic!("{bin}: {e} (install it: apt-get install -y chromium chromium-driver, or scripts/test.sh)")
        });
    wait_for("chromedriver listens", || std::net::TcpStream::connect(("127.0.0.1", port)).is_ok());
    Driver(child, port)
}

async fn browser(driver: &Driver) -> Client {
    let mut caps = serde_json::Map::new();
    let binary = std::env::var("KM0_CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
    caps.insert(
        "goog:chromeOptions".into(),
        serde_json::json!({
            "binary": binary,
            "args": ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,900"]
        }),
    );
    let connector = hyper_util::client::legacy::connect::HttpConnector::new();
    ClientBuilder::new(connector)
        .capabilities(caps)
        .connect(&format!("http://127.0.0.1:{}", driver.1))
        .await
        .expect("a WebDriver session with chromium")
}

/// The text of the element with `id`.
async fn shown(c: &Client, id: &str) -> String {
    c.find(Locator::Id(id)).await.unwrap().text().await.unwrap()
}

/// Poll `ok` (async) every 100 ms, up to 30 s.
async fn until<F: std::future::Future<Output = bool>>(what: &str, mut ok: impl FnMut() -> F) {
    let t = Instant::now();
    while !ok().await {
        assert!(t.elapsed() < Duration::from_secs(30), "{what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn api(url: &str) -> serde_json::Value {
    json(&call(url, "GET", "/api/v1/job", None).unwrap().1)
}

#[test]
fn the_ui_shows_the_apis_numbers_follows_the_watermark_and_deploys_through_its_form() {
    let dir = tempfile::tempdir().unwrap();
    let text = stream(40_000, 51);
    let lines: Vec<&str> = text.lines().collect();
    let part = |l: &[&str]| l.iter().map(|l| format!("{l}\n")).collect::<String>();
    std::fs::write(dir.path().join("live.jsonl"), part(&lines[..20_000])).unwrap();
    let job = stock_pipeline(dir.path(), &dir.path().join("live.jsonl"), "out", "");
    let port = free_port();
    let url = format!("http://127.0.0.1:{port}");
    let child = start_following(&job, port, "ui-token");
    wait_for_read(&url, 20_000);
    let driver = chromedriver();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let c = browser(&driver).await;
        c.goto(&format!("{url}/")).await.unwrap();
        until("the UI shows the records read", || async { shown(&c, "read").await == "20000" }).await;
        let s = api(&url);
        for k in ["read", "filtered", "accepted", "late", "dead_lettered", "emitted", "windows_fired"] {
            assert_eq!(shown(&c, k).await, s["counters"][k].to_string(), "{k}");
        }
        assert_eq!(shown(&c, "pipeline").await, "stock-alert");
        assert_eq!(shown(&c, "state").await, "running");
        let watermark = |c: &Client| {
            let c = c.clone();
            async move { c.find(Locator::Id("watermark")).await.unwrap().attr("data-ms").await.unwrap() }
        };
        let first = s["watermark"].as_i64().unwrap();
        until("the UI shows the API's watermark", || async {
            watermark(&c).await == Some(first.to_string())
        })
        .await;
        let aggregations = shown(&c, "aggregations").await;
        assert!(aggregations.contains("min-stock@0.1.0"), "{aggregations}");
        assert!(aggregations.contains(&s["aggregations"][0]["open_windows"].to_string()), "{aggregations}");

        // More input: the watermark moves, on the page too.
        append(dir.path(), &part(&lines[20_000..]));
        wait_for_read(&url, 40_000);
        let moved = api(&url)["watermark"].as_i64().unwrap();
        assert!(moved > first);
        until("the UI's watermark moves", || async { watermark(&c).await == Some(moved.to_string()) }).await;
        until("the UI shows every record", || async { shown(&c, "read").await == "40000" }).await;
        let late = api(&url)["counters"]["late"].as_u64().unwrap();
        assert!(late > 0, "the stream has late events");
        until("the UI shows the late events' reason", || async {
            shown(&c, "recent").await.contains("late (window-aggregate)")
        })
        .await;

        // A deploy through the form (the token kept for the session, as the page's prompt
        // would keep it).
        c.execute("sessionStorage.setItem('km0-token', arguments[0])", vec![serde_json::json!("ui-token")])
            .await
            .unwrap();
        c.refresh().await.unwrap();
        let v2 = plugin("min-stock-v2");
        c.find(Locator::Id("component")).await.unwrap().send_keys(&v2.to_string_lossy()).await.unwrap();
        c.find(Locator::Css("#deploy button")).await.unwrap().click().await.unwrap();
        until("the deploy's answer shows", || async { shown(&c, "message").await.contains("swapped") }).await;
        assert_eq!(api(&url)["aggregations"][0]["plugin_version"], "0.2.0");
        until("the page shows the new plugin", || async {
            shown(&c, "aggregations").await.contains("min-stock@0.2.0")
        })
        .await;
        let deploys = shown(&c, "deployments").await;
        assert!(deploys.contains("swapped") && deploys.contains("min-stock@0.2.0"), "{deploys}");
        c.close().await.unwrap();
    });
    assert_eq!(call(&url, "POST", "/api/v1/stop?mode=drain", Some("ui-token")).unwrap().0, 200);
    assert!(child.wait_with_output().unwrap().status.success());
}

/// A key made of markup, quarantined: the page shows it as text in the quarantined keys'
/// table (no element is made of it), what the plugin wrote to stderr is among the recent
/// side outputs, and a shadow deploy's comparison shows under Deploys.
#[test]
fn the_ui_shows_quarantined_keys_plugin_output_and_a_shadow_as_text() {
    let dir = tempfile::tempdir().unwrap();
    let poison = "<img id=\"injected\" src=x onerror=\"document.title='owned'\">";
    std::fs::write(dir.path().join("live.jsonl"), poisoned_minutes(poison, 0, 30)).unwrap();
    let job = poisoned_pipeline(dir.path(), poison);
    let port = free_port();
    let url = format!("http://127.0.0.1:{port}");
    let child = start_following(&job, port, "ui-token");
    wait_for("the key is quarantined", || {
        call(&url, "GET", "/api/v1/job", None)
            .is_ok_and(|(_, b)| json(&b)["aggregations"][0]["quarantined"] == 1)
    });
    let (code, body) = send(
        &url,
        "POST",
        "/api/v1/deployments?shadow=true",
        Some("ui-token"),
        &std::fs::read(plugin("hostile")).unwrap(),
    )
    .unwrap();
    assert_eq!(code, 200, "{body}");
    let driver = chromedriver();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let c = browser(&driver).await;
        c.goto(&format!("{url}/")).await.unwrap();
        until("the page shows the quarantined key", || async {
            shown(&c, "quarantined").await.contains(poison)
        })
        .await;
        let table = shown(&c, "quarantined").await;
        assert!(table.contains("panicked at") && table.contains("boom"), "{table}");
        assert!(c.find(Locator::Id("injected")).await.is_err(), "the key became an element");
        assert_ne!(c.title().await.unwrap(), "owned");
        assert!(shown(&c, "aggregations").await.contains("hostile@0.1.0"));
        until("the page shows the plugin's output", || async {
            shown(&c, "recent").await.contains("probe of probe: file Err(")
        })
        .await;
        until("the page shows the shadow", || async {
            shown(&c, "shadow").await.contains("Shadow: hostile@0.1.0 runs beside hostile@0.1.0")
        })
        .await;
        c.close().await.unwrap();
    });
    assert_eq!(call(&url, "POST", "/api/v1/stop", Some("ui-token")).unwrap().0, 200);
    assert!(child.wait_with_output().unwrap().status.success());
}
