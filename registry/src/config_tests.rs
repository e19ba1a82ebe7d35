use proptest::prelude::*;

use super::*;

fn env(kv: &[&str]) -> Vec<String> {
    kv.iter().map(|s| s.to_string()).collect()
}

#[test]
fn values_expand_against_the_value_below() {
    let below = env(&["PATH=/usr/bin", "HOME=/root", "A=x$y"]);
    assert_eq!(expand("/opt/bin:$PATH", &below), "/opt/bin:/usr/bin");
    assert_eq!(expand("${HOME}/go", &below), "/root/go");
    assert_eq!(expand("$HOMEx", &below), "");
    assert_eq!(expand("${HOME}x", &below), "/rootx");
    assert_eq!(
        expand("cost: $$5 $ ${ $1 ${A", &below),
        "cost: $5 $ ${ $1 ${A"
    );
    assert_eq!(
        expand("$A", &below),
        "x$y",
        "a concrete value is not expanded again"
    );
    assert_eq!(expand("$NOPE-", &below), "-");
    assert_eq!(
        expand("/opt/bin:$PATH", &[]),
        format!("/opt/bin:{DEFAULT_PATH}"),
        "an unset PATH is the default, never an empty entry"
    );
}

#[test]
fn a_layer_adds_to_path_and_overrides() {
    let base = ImageConfig {
        env: env(&["PATH=/usr/bin:/bin", "LANG=C"]),
        cmd: vec!["/bin/bash".into()],
        working_dir: Some("/".into()),
        labels: [("a".to_string(), "1".to_string())].into(),
        ..Default::default()
    };
    let tk = LayerConfig {
        env: env(&["PATH=/opt/tk/bin:$PATH", "TK=1"]),
        working_dir: Some("/work".into()),
        labels: [("b".to_string(), "2".to_string())].into(),
        ..Default::default()
    };
    let c = tk.apply(&base);
    assert_eq!(
        c.env,
        env(&["PATH=/opt/tk/bin:/usr/bin:/bin", "LANG=C", "TK=1"])
    );
    assert_eq!(c.cmd, vec!["/bin/bash".to_string()]);
    assert_eq!(c.working_dir.as_deref(), Some("/work"));
    assert_eq!(c.labels.len(), 2);
    // An entrypoint without a cmd clears the cmd below.
    let ep = LayerConfig {
        entrypoint: Some(vec!["/usr/bin/tini".into()]),
        ..Default::default()
    };
    let c2 = ep.apply(&c);
    assert_eq!(c2.entrypoint, vec!["/usr/bin/tini".to_string()]);
    assert!(c2.cmd.is_empty());
    // Declaring an image's config literally reproduces it.
    let lit = ImageConfig {
        env: env(&["X=a$b", "PATH=/p"]),
        ..c2.clone()
    };
    assert_eq!(
        LayerConfig::from_image(&lit).apply(&ImageConfig::default()),
        lit
    );
}

#[test]
fn composition_keeps_unresolved_references() {
    let a = LayerConfig {
        env: env(&["PATH=/a:$PATH"]),
        ..Default::default()
    };
    let b = LayerConfig {
        env: env(&["PATH=/b:$PATH", "P=$$"]),
        ..Default::default()
    };
    assert_eq!(a.then(&b).env, env(&["PATH=/b:/a:${PATH}", "P=$$"]));
}

#[test]
fn composition_never_lets_a_value_see_a_key_set_before_it() {
    // PATH=$B means B below `a`; merged, `PATH=$B$` would see the B that `a` sets first.
    let a = LayerConfig {
        env: env(&["B=$B$", "PATH=$B"]),
        ..Default::default()
    };
    let b = LayerConfig::default();
    let base = ImageConfig::default();
    assert_eq!(a.then(&b).apply(&base), b.apply(&a.apply(&base)));
    assert_eq!(a.then(&b).apply(&base).env, env(&["B=$", "PATH=$"]));
}

fn value() -> impl Strategy<Value = String> {
    proptest::collection::vec(
        prop_oneof![
            Just("$"),
            Just("{"),
            Just("}"),
            Just("A"),
            Just("B"),
            Just("PATH"),
            Just("x"),
            Just(":"),
            Just("_1"),
        ],
        0..6,
    )
    .prop_map(|v| v.concat())
}

fn entry() -> impl Strategy<Value = String> {
    (
        prop_oneof![Just("A"), Just("B"), Just("PATH"), Just("C_1")],
        value(),
    )
        .prop_map(|(k, v)| format!("{k}={v}"))
}

fn args() -> impl Strategy<Value = Option<Vec<String>>> {
    proptest::option::of(proptest::collection::vec(
        prop_oneof![Just("a".to_string()), Just("b".to_string())],
        0..2,
    ))
}

fn layer_config() -> impl Strategy<Value = LayerConfig> {
    (
        proptest::collection::vec(entry(), 0..4),
        args(),
        args(),
        proptest::option::of(prop_oneof![Just("/w".to_string()), Just("/v".to_string())]),
    )
        .prop_map(|(env, entrypoint, cmd, working_dir)| LayerConfig {
            env,
            entrypoint,
            cmd,
            working_dir,
            ..Default::default()
        })
}

proptest! {
    /// Composing two declared configs, then applying, is applying one after the other.
    #[test]
    fn then_is_apply_in_sequence(a in layer_config(), b in layer_config(), below in layer_config()) {
        let base = below.apply(&ImageConfig::default());
        prop_assert_eq!(a.then(&b).apply(&base), b.apply(&a.apply(&base)));
    }
}
