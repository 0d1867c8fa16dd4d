//! The progress bar of a bounded `km0 run` on a terminal (indicatif): bytes of the input
//! read, records, records per second, the watermark and the time left, from the status
//! the job publishes.

use indicatif::{ProgressBar, ProgressStyle};
use km0::job::commands::ControlHandle;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

pub struct Progress {
    done: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Progress {
    /// Remove the bar (the run's summary follows).
    pub fn finish(mut self) {
        self.done.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

pub fn show(handle: ControlHandle) -> Progress {
    let done = Arc::new(AtomicBool::new(false));
    let stop = done.clone();
    let thread = std::thread::Builder::new()
        .name("km0-progress".into())
        .spawn(move || {
            let bar = ProgressBar::new(0);
            let style = ProgressStyle::with_template(
                "{bar:30.cyan/blue} {percent:>3}% {binary_bytes}/{binary_total_bytes} · {msg} · ETA {eta}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar());
            bar.set_style(style);
            while !stop.load(Ordering::SeqCst) {
                let s = handle.status();
                if s.state == km0::job::commands::JobState::Starting {
                    // Not published yet.
                    std::thread::sleep(Duration::from_millis(50));
                    continue;
                }
                if let Some((read, total)) = s.progress {
                    bar.set_length(total);
                    bar.set_position(read);
                }
                let watermark = if s.watermark == i64::MIN { "-".to_string() } else { utc(s.watermark) };
                bar.set_message(format!(
                    "{} records, {:.0}/s, watermark {watermark}",
                    s.counters.read, s.records_per_second
                ));
                std::thread::sleep(Duration::from_millis(100));
            }
            bar.finish_and_clear();
        })
        .ok();
    Progress { done, thread }
}

/// An epoch-ms time as `YYYY-MM-DD HH:MM:SS` UTC (proleptic Gregorian calendar).
fn utc(ms: i64) -> String {
    let (days, secs) = (ms.div_euclid(86_400_000), ms.rem_euclid(86_400_000) / 1000);
    // Days since 1970-01-01 to a civil date (H. Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02}", secs / 3600, secs / 60 % 60, secs % 60)
}

#[cfg(test)]
mod tests {
    #[test]
    fn utc_times_match_known_dates() {
        assert_eq!(super::utc(0), "1970-01-01 00:00:00");
        // The stock stream's start: 2025-09-14 08:00 UTC.
        assert_eq!(super::utc(1_757_836_800_000), "2025-09-14 08:00:00");
        assert_eq!(super::utc(951_782_400_000 + 3_661_000), "2000-02-29 01:01:01");
        assert_eq!(super::utc(-1000), "1969-12-31 23:59:59");
    }
}
