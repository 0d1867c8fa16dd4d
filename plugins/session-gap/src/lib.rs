//! Delivery panel (Kilómetro Cero, case (b)): repartidores without signal. Runs on a
//! session window whose gap is the silence that counts as "no signal": when a session
//! closes, the repartidor sent positions continuously from `desde` to `hasta` and then
//! nothing for at least the gap.

use km0_plugin::{Aggregate, Config, Events, Field, Group, Output};
use serde::{Deserialize, Serialize};

/// State schema 1.
#[derive(Default, Serialize, Deserialize)]
pub struct Acc {
    positions: u64,
    first: Option<i64>,
    last: Option<i64>,
}

pub struct SessionGap;

#[derive(Serialize)]
struct NoSignal<'a> {
    repartidor: &'a str,
    desde: i64,
    hasta: i64,
    posiciones: u64,
    estado: &'static str,
}

impl Aggregate for SessionGap {
    const NAME: &'static str = "session-gap";
    const STATE_SCHEMA: u32 = 1;
    const FIELDS: &'static [Field] = &[];
    const KEY_FIELDS: u32 = 1;
    type Acc = Acc;

    fn configure(config: &Config) -> Result<Self, String> {
        config.only(&[])?;
        Ok(SessionGap)
    }

    fn add(&self, acc: &mut Acc, _group: &Group<'_>, events: &Events<'_>) {
        for &t in events.times() {
            acc.first = Some(acc.first.map_or(t, |f| f.min(t)));
            acc.last = Some(acc.last.map_or(t, |l| l.max(t)));
        }
        acc.positions += events.len() as u64;
    }

    fn merge(&self, acc: &mut Acc, other: Acc) {
        acc.first = match (acc.first, other.first) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        acc.last = match (acc.last, other.last) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
        acc.positions += other.positions;
    }

    fn finish(&self, acc: &Acc, group: &Group<'_>, out: &mut Output) {
        if let (Some(desde), Some(hasta)) = (acc.first, acc.last) {
            out.emit(&NoSignal {
                repartidor: group.key(0),
                desde,
                hasta,
                posiciones: acc.positions,
                estado: "sin_senal",
            });
        }
    }
}

km0_plugin::export_plugin!(SessionGap);
