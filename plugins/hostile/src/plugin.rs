// The hostile plugin's logic, shared by `hostile` and `hostile-ordered` (include!d with
// PLUGIN_NAME and ORDERED defined).

use km0_plugin::{Aggregate, Config, Events, Field, Group, Output};
use serde::{Deserialize, Serialize};

#[derive(Default, Serialize, Deserialize)]
pub struct Acc {
    n: u64,
}

pub struct Hostile {
    behaviour: String,
    /// With `panic_on`: the key whose events make it panic.
    key: String,
    /// With `panic_at`: the event time that makes it panic.
    time: i64,
    /// With `poisoned`: the keys it loops, allocates, panics and probes on.
    loop_key: String,
    alloc_key: String,
    panic_key: String,
    probe_key: String,
}

impl Aggregate for Hostile {
    const NAME: &'static str = PLUGIN_NAME;
    const STATE_SCHEMA: u32 = 1;
    const FIELDS: &'static [Field] = &[];
    const KEY_FIELDS: u32 = 1;
    const ORDERED_INPUT: bool = ORDERED;
    type Acc = Acc;

    fn configure(config: &Config) -> Result<Self, String> {
        config.only(&["behaviour", "key", "time", "loop_key", "alloc_key", "panic_key", "probe_key"])?;
        let text = |name: &str| config.get(name).and_then(|v| v.as_str()).unwrap_or("").to_string();
        let behaviour = Some(text("behaviour")).filter(|b| !b.is_empty()).unwrap_or_else(|| "probe".into());
        Ok(Hostile {
            behaviour,
            key: text("key"),
            time: config.int_or("time", i64::MIN)?,
            loop_key: text("loop_key"),
            alloc_key: text("alloc_key"),
            panic_key: text("panic_key"),
            probe_key: text("probe_key"),
        })
    }

    fn add(&self, acc: &mut Acc, group: &Group<'_>, events: &Events<'_>) {
        let behaviour = match self.behaviour.as_str() {
            "poisoned" => {
                let key = group.key(0);
                if key == self.loop_key {
                    "loop"
                } else if key == self.alloc_key {
                    "alloc"
                } else if key == self.panic_key {
                    panic!("boom")
                } else {
                    if key == self.probe_key {
                        let (file, dir, net) = probe();
                        eprintln!("probe of {key}: file {file}, dir {dir}, net {net}, env {}", std::env::vars().count());
                    }
                    "count"
                }
            }
            other => other,
        };
        match behaviour {
            "loop" => {
                let mut x: u64 = events.len() as u64;
                loop {
                    x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
                }
            }
            "alloc_4g" => {
                // One allocation of almost all of a 32-bit address space.
                let big = vec![1u8; u32::MAX as usize - (64 << 20)];
                acc.n += std::hint::black_box(&big).len() as u64;
            }
            "alloc" => {
                let mut hoard: Vec<Vec<u8>> = Vec::new();
                loop {
                    hoard.push(vec![1u8; 64 << 20]);
                    std::hint::black_box(&hoard);
                }
            }
            "panic" => panic!("hostile plugin panics on purpose"),
            "sleep" => {
                std::thread::sleep(std::time::Duration::from_secs(5));
                acc.n += events.len() as u64;
            }
            "sleep_forever" => loop {
                std::thread::sleep(std::time::Duration::from_secs(1));
            },
            "panic_on" if group.key(0) == self.key => panic!("hostile plugin panics on key {}", self.key),
            "panic_at" if events.times().contains(&self.time) => {
                panic!("hostile plugin panics on the event at {}", self.time)
            }
            _ => acc.n += events.len() as u64,
        }
    }

    fn merge(&self, acc: &mut Acc, other: Acc) {
        if self.behaviour == "merge_panic" {
            panic!("hostile plugin panics in merge on purpose");
        }
        acc.n += other.n;
    }

    fn finish(&self, acc: &Acc, group: &Group<'_>, out: &mut Output) {
        match self.behaviour.as_str() {
            "poisoned" => out.emit(&serde_json::json!({ "key": group.key(0), "events": acc.n })),
            "garbage" => out.emit_raw("this is {not json"),
            "huge" => out.emit(&serde_json::json!({ "key": group.key(0), "blob": "x".repeat(2 << 20) })),
            "big" => out.emit(&serde_json::json!({ "key": group.key(0), "blob": "x".repeat(300_000) })),
            _ => {
                let (file, dir, net) = probe();
                let wall_ms = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_millis() as u64)
                    .unwrap_or(0);
                let t = std::time::Instant::now();
                std::thread::sleep(std::time::Duration::from_millis(50));
                let slept_ns = t.elapsed().as_nanos() as u64;
                out.emit(&serde_json::json!({
                    "key": group.key(0),
                    "events": acc.n,
                    "file": file,
                    "dir": dir,
                    "env": std::env::vars().count(),
                    "args": std::env::args().count(),
                    "net": net,
                    "wall_ms": wall_ms,
                    "slept_ns": slept_ns,
                }));
            }
        }
    }
}


/// What the filesystem and the network give: `/etc/passwd`'s length, the entries of `/`,
/// a connection to 127.0.0.1:9 (each `Ok(..)` or `Err(reason)`, debug-printed).
fn probe() -> (String, String, String) {
    let file = std::fs::read_to_string("/etc/passwd").map(|s| s.len()).map_err(|e| e.to_string());
    let dir = std::fs::read_dir("/").map(|d| d.count()).map_err(|e| e.to_string());
    let net = std::net::TcpStream::connect("127.0.0.1:9").map(|_| ()).map_err(|e| e.to_string());
    (format!("{file:?}"), format!("{dir:?}"), format!("{net:?}"))
}
