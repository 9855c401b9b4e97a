//! Keras-style progress: `Epoch 1/3`, then a step counter with loss and metrics. On a terminal
//! one line is redrawn in place with a bar; otherwise (the journal, a pipe) a plain line is
//! printed at every tenth of the epoch, and one at its end, with no escape codes. In the journal
//! warnings and errors carry their syslog priority (`<4>`, `<3>`); with `--log-format json`
//! every line is a JSON object (`message`, or `event` `step`/`epoch_end` with the values).

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

use crate::ops::log::LogFormat;

/// How lines are drawn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Style {
    /// Redrawn in place, with a bar.
    Terminal,
    /// Plain lines; `journal`: with syslog priorities.
    Lines { journal: bool },
    /// JSON objects.
    Json,
}

/// Where progress goes and how it is drawn.
pub(crate) struct Progress {
    out: Box<dyn Write + Send>,
    style: Style,
    last_draw: Option<Instant>,
    step_lines: bool,
    epoch: u32,
}

/// How often a terminal line is redrawn.
const REDRAW: Duration = Duration::from_millis(100);
const BAR_WIDTH: usize = 30;

impl Progress {
    /// Progress on standard output in `format`, drawn for a terminal when it is one.
    pub(crate) fn stdout(format: LogFormat) -> Progress {
        let style = match format {
            LogFormat::Json => Style::Json,
            LogFormat::Plain if std::io::stdout().is_terminal() => Style::Terminal,
            LogFormat::Plain => Style::Lines { journal: crate::ops::log::journal(std::io::stdout()) },
        };
        Progress { out: Box::new(std::io::stdout()), style, last_draw: None, step_lines: true, epoch: 0 }
    }

    /// Progress into any writer, plain lines unless `tty`.
    #[cfg(test)]
    pub(crate) fn to_writer(out: Box<dyn Write + Send>, tty: bool) -> Progress {
        let style = if tty { Style::Terminal } else { Style::Lines { journal: false } };
        Progress { out, style, last_draw: None, step_lines: true, epoch: 0 }
    }

    /// Only epoch lines, no step lines (workers other than the chief print less).
    pub(crate) fn without_step_lines(mut self) -> Progress {
        self.step_lines = false;
        self
    }

    fn tty(&self) -> bool {
        self.style == Style::Terminal
    }

    fn json(&mut self, mut object: serde_json::Value) {
        let time = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
        object["time"] = time.into();
        let _ = writeln!(self.out, "{object}");
        let _ = self.out.flush();
    }

    /// Prints a line as it is (for messages between epochs); one that starts with `warning:` or
    /// `error:` carries that level.
    pub(crate) fn line(&mut self, text: &str) {
        let level = if text.starts_with("error:") {
            tracing::Level::ERROR
        } else if text.starts_with("warning:") {
            tracing::Level::WARN
        } else {
            tracing::Level::INFO
        };
        match self.style {
            Style::Json => {
                let level = level.as_str().to_lowercase();
                self.json(serde_json::json!({"level": level, "message": text}));
                return;
            }
            Style::Lines { journal: true } => {
                let _ = writeln!(self.out, "<{}>{text}", crate::ops::log::priority(level));
            }
            _ => {
                let _ = writeln!(self.out, "{text}");
            }
        }
        let _ = self.out.flush();
    }

    /// `Epoch i/n` (1-based).
    pub(crate) fn epoch_start(&mut self, epoch: u32, epochs: u32) {
        self.last_draw = None;
        self.epoch = epoch;
        if self.style == Style::Json {
            return; // each step and epoch_end object names its epoch
        }
        self.line(&format!("Epoch {}/{epochs}", epoch + 1));
    }

    /// Whether [`Progress::step`] would draw at this step; lets the caller skip computing the
    /// values (which waits for the device) when it would not.
    pub(crate) fn wants(&self, step: u64, steps: u64) -> bool {
        if step == steps || !self.step_lines {
            return false; // the epoch's end line follows
        }
        if self.tty() {
            self.last_draw.is_none_or(|t| t.elapsed() >= REDRAW)
        } else {
            let tenth = (steps / 10).max(1);
            step.is_multiple_of(tenth)
        }
    }

    fn values_json(
        &self,
        event: &str,
        step: u64,
        steps: u64,
        elapsed: Duration,
        values: &[(String, f64)],
    ) -> serde_json::Value {
        let mut object = serde_json::json!({
            "level": "info",
            "event": event,
            "epoch": self.epoch + 1,
            "step": step,
            "steps": steps,
            "seconds": elapsed.as_secs_f64(),
        });
        for (name, value) in values {
            object[name] = (*value).into();
        }
        object
    }

    /// Draws step `step` of `steps` (1-based, done so far) with running values.
    pub(crate) fn step(&mut self, step: u64, steps: u64, elapsed: Duration, values: &[(String, f64)]) {
        self.last_draw = Some(Instant::now());
        if self.style == Style::Json {
            let object = self.values_json("step", step, steps, elapsed, values);
            return self.json(object);
        }
        let text = step_line(step, steps, elapsed, None, values, self.tty());
        if self.tty() {
            let _ = write!(self.out, "\r{text}\x1b[K");
            let _ = self.out.flush();
        } else {
            self.line(&text);
        }
    }

    /// Ends a bar drawn in place on a terminal (its line stays; the next starts below it).
    /// Elsewhere every step was a line of its own: nothing to end.
    pub(crate) fn finish_bar(&mut self) {
        if self.tty() && self.last_draw.take().is_some() {
            let _ = writeln!(self.out);
            let _ = self.out.flush();
        }
    }

    /// The epoch's last line, as Keras prints it: time, per-step time, values (evaluation
    /// included), and throughput (examples, and tokens when the model reads them).
    pub(crate) fn epoch_end(
        &mut self,
        steps: u64,
        elapsed: Duration,
        values: &[(String, f64)],
        (examples_per_second, tokens_per_second): (f64, Option<f64>),
    ) {
        if self.style == Style::Json {
            let mut object = self.values_json("epoch_end", steps, steps, elapsed, values);
            object["examples_per_second"] = examples_per_second.into();
            if let Some(tokens) = tokens_per_second {
                object["tokens_per_second"] = tokens.into();
            }
            return self.json(object);
        }
        let per_step = elapsed.as_secs_f64() * 1e3 / steps.max(1) as f64;
        let mut text = step_line(steps, steps, elapsed, Some(per_step), values, self.tty());
        text.push_str(&format!(" - {} examples/s", thousands(examples_per_second)));
        if let Some(tokens) = tokens_per_second {
            text.push_str(&format!(" - {} tokens/s", thousands(tokens)));
        }
        if self.tty() {
            let _ = write!(self.out, "\r{text}\x1b[K\n");
            let _ = self.out.flush();
        } else {
            self.line(&text);
        }
    }
}

/// A language model's figures: each loss (`loss`, `val_loss`) followed by its perplexity (`exp` of
/// the mean cross-entropy per token).
pub(crate) fn with_perplexity(values: Vec<(String, f64)>) -> Vec<(String, f64)> {
    let mut out = Vec::with_capacity(values.len() + 2);
    for (name, value) in values {
        let perplexity = name.strip_suffix("loss").map(|prefix| (format!("{prefix}perplexity"), value.exp()));
        out.push((name, value));
        out.extend(perplexity);
    }
    out
}

/// A value as Keras's progress bar prints it: four decimals, or scientific notation with a
/// two-digit exponent at or below 1e-3 (`0.4521`, `1.0000e-04`).
pub(crate) fn keras_number(value: f64) -> String {
    if value.abs() > 1e-3 || !value.is_finite() {
        return format!("{value:.4}");
    }
    let text = format!("{value:.4e}");
    let (mantissa, exponent) = text.split_once('e').expect("scientific notation");
    let exponent: i32 = exponent.parse().expect("an integer exponent");
    let sign = if exponent < 0 { '-' } else { '+' };
    format!("{mantissa}e{sign}{:02}", exponent.abs())
}

/// `step/steps [bar] - 3s[ 5ms/step] - loss: 0.4521 - accuracy: 0.8412` (no bar when not a
/// terminal).
pub(crate) fn step_line(
    step: u64,
    steps: u64,
    elapsed: Duration,
    ms_per_step: Option<f64>,
    values: &[(String, f64)],
    bar: bool,
) -> String {
    let width = steps.to_string().len();
    let mut text = format!("{step:>width$}/{steps}");
    if bar {
        text.push_str(&format!(" [{}]", bar_text(step, steps)));
    }
    text.push_str(&format!(" - {}s", elapsed.as_secs()));
    if let Some(ms) = ms_per_step {
        text.push_str(&format!(" {ms:.0}ms/step"));
    }
    for (name, value) in values {
        text.push_str(&format!(" - {name}: {}", keras_number(*value)));
    }
    text
}

fn bar_text(step: u64, steps: u64) -> String {
    let done = (step * BAR_WIDTH as u64).checked_div(steps).map_or(BAR_WIDTH, |d| d as usize);
    if done >= BAR_WIDTH {
        "=".repeat(BAR_WIDTH)
    } else {
        format!("{}>{}", "=".repeat(done), ".".repeat(BAR_WIDTH - done - 1))
    }
}

/// `12345.6` as `12,346`.
pub(crate) fn thousands(x: f64) -> String {
    let digits = format!("{:.0}", x.max(0.0));
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_language_model_shows_its_perplexity_after_each_loss() {
        let values = vec![("loss".to_string(), 2.0), ("accuracy".into(), 0.5), ("val_loss".into(), 1.0)];
        let names: Vec<(String, String)> =
            with_perplexity(values).into_iter().map(|(n, v)| (n, keras_number(v))).collect();
        let expected = [("loss", "2.0000"), ("perplexity", "7.3891"), ("accuracy", "0.5000"), ("val_loss", "1.0000")];
        assert_eq!(names[..4], expected.map(|(n, v)| (n.to_string(), v.to_string())));
        assert_eq!(names[4], ("val_perplexity".to_string(), "2.7183".to_string()));
    }

    #[test]
    fn numbers_are_printed_as_keras_prints_them() {
        assert_eq!(keras_number(0.45213), "0.4521");
        assert_eq!(keras_number(0.001), "1.0000e-03");
        assert_eq!(keras_number(1e-5), "1.0000e-05");
        assert_eq!(keras_number(0.0), "0.0000e+00");
        assert_eq!(keras_number(-2.5e-4), "-2.5000e-04");
        assert_eq!(keras_number(12.0), "12.0000");
    }

    #[test]
    fn keras_style_lines() {
        let values = vec![("loss".to_string(), 0.45213), ("accuracy".to_string(), 0.84)];
        assert_eq!(
            step_line(93, 937, Duration::from_secs(3), None, &values, false),
            " 93/937 - 3s - loss: 0.4521 - accuracy: 0.8400"
        );
        assert_eq!(
            step_line(468, 937, Duration::from_secs(3), None, &[], true),
            "468/937 [==============>...............] - 3s"
        );
        assert_eq!(
            step_line(937, 937, Duration::from_secs(5), Some(5.4), &[], true),
            "937/937 [==============================] - 5s 5ms/step"
        );
        assert_eq!(thousands(5210.4), "5,210");
        assert_eq!(thousands(999.0), "999");
        assert_eq!(thousands(1234567.0), "1,234,567");
    }

    /// A writer the test can read back.
    #[derive(Clone, Default)]
    struct Shared(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

    impl Write for Shared {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().write(buf)
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn the_journal_gets_priorities_and_json_gets_objects() {
        let out = Shared::default();
        let mut p =
            Progress { style: Style::Lines { journal: true }, ..Progress::to_writer(Box::new(out.clone()), false) };
        p.line("trainerd: 2 worker(s) joined");
        p.line("warning: checkpoint at step 5 skipped");
        let text = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
        assert_eq!(text, "<6>trainerd: 2 worker(s) joined\n<4>warning: checkpoint at step 5 skipped\n");

        let out = Shared::default();
        let mut p = Progress { style: Style::Json, ..Progress::to_writer(Box::new(out.clone()), false) };
        p.epoch_start(1, 3);
        p.step(10, 100, Duration::from_secs(2), &[("loss".into(), 0.5)]);
        p.line("warning: x");
        let text = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
        let lines: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(
            (lines[0]["event"].as_str(), lines[0]["epoch"].as_u64(), lines[0]["loss"].as_f64()),
            (Some("step"), Some(2), Some(0.5))
        );
        assert_eq!((lines[1]["level"].as_str(), lines[1]["message"].as_str()), (Some("warn"), Some("warning: x")));
    }

    #[test]
    fn plain_output_prints_every_tenth() {
        let p = Progress::to_writer(Box::new(Vec::new()), false);
        let drawn: Vec<u64> = (1..=100).filter(|&s| p.wants(s, 100)).collect();
        assert_eq!(drawn, [10, 20, 30, 40, 50, 60, 70, 80, 90]);
    }
}
