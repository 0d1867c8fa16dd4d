//! Delivery panel (Kilómetro Cero, case (b)): distance travelled per repartidor over a
//! sliding window, as the haversine distance between consecutive positions in event-time
//! order. Declares ordered input, so each pane's positions arrive sorted, and merges
//! panes earliest first: the distance of a window is the panes' distances plus the legs
//! that join one pane's last position to the next pane's first.

use km0_plugin::{Aggregate, Config, Events, Field, Group, Output};
use serde::{Deserialize, Serialize};

/// Mean Earth radius, metres (IUGG).
const EARTH_RADIUS_M: f64 = 6_371_008.8;

/// A position: event time, latitude, longitude (degrees).
#[derive(Clone, Copy, Serialize, Deserialize)]
pub struct Fix(i64, f64, f64);

/// State schema 1.
#[derive(Default, Serialize, Deserialize)]
pub struct Acc {
    positions: u64,
    first: Option<Fix>,
    last: Option<Fix>,
    metres: f64,
}

/// Great-circle distance between two positions, metres.
pub fn haversine_m(a: Fix, b: Fix) -> f64 {
    Point::new(a).metres_to(&Point::new(b))
}

/// A position with its latitude in radians and that latitude's cosine, which the legs
/// both to and from it use (computed once a position, not once a leg).
struct Point {
    fix: Fix,
    lat: f64,
    cos_lat: f64,
}

impl Point {
    fn new(fix: Fix) -> Point {
        let lat = fix.1.to_radians();
        Point { fix, lat, cos_lat: lat.cos() }
    }

    /// The haversine distance to `b`, metres.
    fn metres_to(&self, b: &Point) -> f64 {
        let dla = b.lat - self.lat;
        let dlo = (b.fix.2 - self.fix.2).to_radians();
        let h = (dla / 2.0).sin().powi(2) + self.cos_lat * b.cos_lat * (dlo / 2.0).sin().powi(2);
        // sqrt(h), which rounding can take past 1, clamped to 1: by a comparison, which
        // gives what `f64::min` gives for every value, NaN included (in WebAssembly,
        // `min` is a call to libm's `fmin`).
        let s = h.sqrt();
        let s = if s < 1.0 { s } else { 1.0 };
        2.0 * EARTH_RADIUS_M * s.asin()
    }
}

pub struct Distance;

#[derive(Serialize)]
struct Panel<'a> {
    repartidor: &'a str,
    ventana_inicio: i64,
    ventana_fin: i64,
    distancia_m: f64,
    posiciones: u64,
}

impl Aggregate for Distance {
    const NAME: &'static str = "distance";
    const STATE_SCHEMA: u32 = 1;
    const FIELDS: &'static [Field] = &[Field::float("lat"), Field::float("lon")];
    const KEY_FIELDS: u32 = 1;
    const ORDERED_INPUT: bool = true;
    type Acc = Acc;

    fn configure(config: &Config) -> Result<Self, String> {
        config.only(&[])?;
        Ok(Distance)
    }

    fn add(&self, acc: &mut Acc, _group: &Group<'_>, events: &Events<'_>) {
        let (times, lat, lon) = (events.times(), events.floats(0), events.floats(1));
        let mut last = acc.last.map(Point::new);
        for i in 0..events.len() {
            let here = Point::new(Fix(times[i], lat[i], lon[i]));
            if let Some(last) = &last {
                acc.metres += last.metres_to(&here);
            }
            acc.first.get_or_insert(here.fix);
            acc.last = Some(here.fix);
            acc.positions += 1;
            last = Some(here);
        }
    }

    fn merge(&self, acc: &mut Acc, later: Acc) {
        if let (Some(last), Some(first)) = (acc.last, later.first) {
            acc.metres += haversine_m(last, first);
        }
        acc.metres += later.metres;
        acc.positions += later.positions;
        acc.first = acc.first.or(later.first);
        acc.last = later.last.or(acc.last);
    }

    fn finish(&self, acc: &Acc, group: &Group<'_>, out: &mut Output) {
        if acc.positions > 0 {
            out.emit(&Panel {
                repartidor: group.key(0),
                ventana_inicio: group.window_start,
                ventana_fin: group.window_end,
                distancia_m: acc.metres,
                posiciones: acc.positions,
            });
        }
    }
}

km0_plugin::export_plugin!(Distance);
