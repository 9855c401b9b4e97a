//! The schedules against Hugging Face's `transformers.optimization`, step by step; the formulas
//! of older commits; and the flags.

use super::*;

fn curve(schedule: &LrSchedule, warmup: Option<Warmup>) -> Curve<'_> {
    Curve { schedule, warmup, formulas: FORMULAS }
}

/// (trainerd's schedule, its warmup, the run's steps, the `transformers` call it equals).
fn cases() -> Vec<(LrSchedule, Option<Warmup>, u64, String)> {
    let cosine_floor = LrSchedule::Cosine { min_lr: 3e-5 };
    let wsd = |decay, min_lr_ratio, shape| LrSchedule::Wsd { decay, min_lr_ratio, shape };
    vec![
        (LrSchedule::Constant, Some(Warmup::Steps(10)), 60, "get_constant_schedule_with_warmup(o, 10)".into()),
        (LrSchedule::Linear, Some(Warmup::Steps(10)), 100, "get_linear_schedule_with_warmup(o, 10, 100)".into()),
        (LrSchedule::Linear, None, 37, "get_linear_schedule_with_warmup(o, 0, 37)".into()),
        (
            LrSchedule::Cosine { min_lr: 0.0 },
            Some(Warmup::Steps(7)),
            50,
            "get_cosine_schedule_with_warmup(o, 7, 50)".into(),
        ),
        (LrSchedule::Cosine { min_lr: 0.0 }, None, 41, "get_cosine_schedule_with_warmup(o, 0, 41)".into()),
        // A fraction of the run: Hugging Face's ceil(0.05 * 90) = 5 steps.
        (
            LrSchedule::Cosine { min_lr: 0.0 },
            Some(Warmup::Ratio(0.05)),
            90,
            "get_cosine_schedule_with_warmup(o, 5, 90)".into(),
        ),
        (
            cosine_floor.clone(),
            Some(Warmup::Steps(12)),
            80,
            "get_cosine_with_min_lr_schedule_with_warmup(o, 12, 80, min_lr=3e-5)".into(),
        ),
        (
            wsd(0.2, 0.1, DecayShape::Cosine),
            Some(Warmup::Steps(5)),
            100,
            "get_wsd_schedule(o, 5, 20, num_training_steps=100, min_lr_ratio=0.1)".into(),
        ),
        (
            wsd(0.25, 0.0, DecayShape::Linear),
            Some(Warmup::Steps(4)),
            70,
            // round(0.25 * 70) = 18 (17.5 rounds away from 0)
            "get_wsd_schedule(o, 4, 18, num_training_steps=70, decay_type='linear')".into(),
        ),
        (
            wsd(0.5, 0.05, DecayShape::Sqrt),
            None,
            30,
            "get_wsd_schedule(o, 0, 15, num_training_steps=30, decay_type='1-sqrt', min_lr_ratio=0.05)".into(),
        ),
    ]
}

/// Each schedule against the `transformers` function it equals, at every step of a run, with
/// and without a warmup: the learning rate PyTorch's `LambdaLR` gives each optimizer step.
#[test]
fn every_schedule_is_the_transformers_function_at_every_step() {
    let base = 3e-4;
    let cases = cases();
    let calls: Vec<String> = cases.iter().map(|(.., total, call)| format!("({total}, lambda o: {call})")).collect();
    let script = format!(
        r#"
import json, torch, warnings
from transformers.optimization import *
warnings.simplefilter("ignore")
out = []
for total, make in [{calls}]:
    p = torch.nn.Parameter(torch.zeros(1))
    o = torch.optim.SGD([p], lr={base:e})
    s = make(o)
    lrs = []
    for _ in range(total):
        lrs.append(o.param_groups[0]["lr"])
        o.step()
        s.step()
    out.append(lrs)
print(json.dumps(out))
"#,
        calls = calls.join(", ")
    );
    let run = std::process::Command::new(trainerd_testkit::python()).args(["-c", &script]).output().unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let theirs: Vec<Vec<f64>> = serde_json::from_slice(&run.stdout).unwrap();
    for ((schedule, warmup, total, call), theirs) in cases.iter().zip(theirs) {
        let ours: Vec<f64> = (0..*total).map(|s| curve(schedule, *warmup).lr(base, s, *total)).collect();
        for (step, (a, b)) in ours.iter().zip(&theirs).enumerate() {
            assert!(a == b, "{call}: step {step}: trainerd {a:e}, transformers {b:e}");
        }
    }
}

/// A run started before Hugging Face's formulas keeps its cosine: the floor at the last step.
#[test]
fn the_first_formulas_keep_the_old_cosine() {
    let cos = LrSchedule::Cosine { min_lr: 0.0 };
    let old = Curve { schedule: &cos, warmup: None, formulas: FIRST_FORMULAS };
    assert_eq!(old.lr(0.1, 0, 11), 0.1);
    assert!((old.lr(0.1, 5, 11) - 0.05).abs() < 1e-12);
    assert!(old.lr(0.1, 10, 11).abs() < 1e-12);
    // Hugging Face's is not at its floor at the last step.
    assert!(
        (curve(&cos, None).lr(0.1, 10, 11) - 0.1 * 0.5 * (1.0 + (std::f64::consts::PI / 11.0 * 10.0).cos())).abs()
            < 1e-15
    );
    // Every other schedule is the same under both.
    for schedule in
        [LrSchedule::Constant, LrSchedule::Step { every: 10, gamma: 0.5 }, LrSchedule::Exponential { gamma: 0.9 }]
    {
        let old = Curve { schedule: &schedule, warmup: None, formulas: FIRST_FORMULAS };
        for step in 0..40 {
            assert_eq!(old.lr(0.1, step, 40).to_bits(), curve(&schedule, None).lr(0.1, step, 40).to_bits());
        }
    }
}

#[test]
fn schedules() {
    assert_eq!(curve(&LrSchedule::Constant, None).lr(0.1, 99, 100), 0.1);
    let step = LrSchedule::Step { every: 10, gamma: 0.5 };
    assert_eq!(curve(&step, None).lr(0.1, 9, 100), 0.1);
    assert_eq!(curve(&step, None).lr(0.1, 20, 100), 0.025);
    // After a warmup, the decays count from its end.
    assert_eq!(curve(&step, Some(Warmup::Steps(5))).lr(0.1, 2, 100), 0.1 * (2.0 / 5.0));
    assert_eq!(curve(&step, Some(Warmup::Steps(5))).lr(0.1, 14, 100), 0.1);
    assert_eq!(curve(&step, Some(Warmup::Steps(5))).lr(0.1, 15, 100), 0.05);
    assert!((curve(&LrSchedule::Exponential { gamma: 0.9 }, None).lr(1.0, 2, 5) - 0.81).abs() < 1e-12);
}

#[test]
fn parse_flags() {
    assert_eq!(parse("step:100:0.5"), Ok(LrSchedule::Step { every: 100, gamma: 0.5 }));
    assert_eq!(parse("cosine"), Ok(LrSchedule::Cosine { min_lr: 0.0 }));
    assert_eq!(parse("linear"), Ok(LrSchedule::Linear));
    assert_eq!(parse("wsd:0.2"), Ok(LrSchedule::Wsd { decay: 0.2, min_lr_ratio: 0.0, shape: DecayShape::Cosine }));
    assert_eq!(
        parse("wsd:0.1:0.05:1-sqrt"),
        Ok(LrSchedule::Wsd { decay: 0.1, min_lr_ratio: 0.05, shape: DecayShape::Sqrt })
    );
    assert_eq!(
        parse("step:0:0.5").unwrap_err().to_string(),
        "--lr-schedule step:0:0.5: EVERY \"0\" is not a positive integer"
    );
    assert_eq!(
        parse("wsd:1.5").unwrap_err().to_string(),
        "--lr-schedule wsd:1.5: DECAY \"1.5\" is not a fraction from 0 to 1"
    );
    assert_eq!(
        parse("wsd:0.2:0:square").unwrap_err().to_string(),
        "--lr-schedule wsd:0.2:0:square: SHAPE \"square\" is not cosine, linear or 1-sqrt"
    );
    assert_eq!(
        parse("polynomial").unwrap_err().to_string(),
        "--lr-schedule polynomial: expected constant, linear, cosine[:MIN_LR], \
         wsd:DECAY[:MIN_LR_RATIO[:cosine|linear|1-sqrt]], step:EVERY:GAMMA or exp:GAMMA"
    );
}

#[test]
fn warmup_flags() {
    assert_eq!(Warmup::parse("100"), Ok(Warmup::Steps(100)));
    assert_eq!(Warmup::parse("0.05"), Ok(Warmup::Ratio(0.05)));
    assert_eq!(Warmup::Ratio(0.05).steps(90), 5);
    assert_eq!(Warmup::Ratio(0.05).steps(101), 6);
    for bad in ["1.5", "-3", "ten", "0.0"] {
        assert_eq!(
            Warmup::parse(bad).unwrap_err().to_string(),
            format!(
                "--warmup-steps {bad}: expected a number of steps, or a fraction of the run's steps between 0 and 1 \
                 (0.05)"
            )
        );
    }
}
