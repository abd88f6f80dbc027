//! The AWS shared files' part of the standard credential chain, which `object_store`
//! leaves out: `~/.aws/credentials` and `~/.aws/config` (or `AWS_SHARED_CREDENTIALS_FILE`
//! and `AWS_CONFIG_FILE`), profile `AWS_PROFILE` or `default`. Used only for what the
//! environment does not set, so environment variables keep their precedence; instance
//! and container credentials come after both (object_store's own chain).

use std::path::PathBuf;

use object_store::aws::AmazonS3ConfigKey;

/// The settings of the active profile that the environment leaves unset.
pub fn settings() -> Vec<(AmazonS3ConfigKey, String)> {
    let profile = std::env::var("AWS_PROFILE").unwrap_or_else(|_| "default".into());
    let home = std::env::var_os("HOME").map(PathBuf::from);
    let file = |var: &str, name: &str| {
        std::env::var_os(var)
            .map(PathBuf::from)
            .or_else(|| home.as_ref().map(|h| h.join(".aws").join(name)))
    };
    let mut found = Vec::new();
    if let Some(text) = file("AWS_SHARED_CREDENTIALS_FILE", "credentials")
        .and_then(|p| std::fs::read_to_string(p).ok())
    {
        found.extend(section(&text, &profile));
    }
    // The config file names its sections "profile NAME", except "default".
    let in_config = if profile == "default" {
        profile.clone()
    } else {
        format!("profile {profile}")
    };
    if let Some(text) =
        file("AWS_CONFIG_FILE", "config").and_then(|p| std::fs::read_to_string(p).ok())
    {
        found.extend(section(&text, &in_config));
    }
    let mut out: Vec<(AmazonS3ConfigKey, String)> = Vec::new();
    for (k, v) in found {
        let (key, env) = match k.as_str() {
            "aws_access_key_id" => (AmazonS3ConfigKey::AccessKeyId, "AWS_ACCESS_KEY_ID"),
            "aws_secret_access_key" => {
                (AmazonS3ConfigKey::SecretAccessKey, "AWS_SECRET_ACCESS_KEY")
            }
            "aws_session_token" => (AmazonS3ConfigKey::Token, "AWS_SESSION_TOKEN"),
            "region" => (AmazonS3ConfigKey::Region, "AWS_REGION"),
            "endpoint_url" => (AmazonS3ConfigKey::Endpoint, "AWS_ENDPOINT_URL"),
            _ => continue,
        };
        // The environment wins, and the credentials file over the config file.
        if std::env::var_os(env).is_some() || out.iter().any(|(o, _)| *o == key) {
            continue;
        }
        out.push((key, v));
    }
    out
}

/// `key = value` lines of section `[name]` of an INI file (keys lower-cased).
fn section(text: &str, name: &str) -> Vec<(String, String)> {
    let mut inside = false;
    let mut out = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        if let Some(h) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            inside = h.trim() == name;
            continue;
        }
        if inside {
            if let Some((k, v)) = line.split_once('=') {
                out.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::section;

    #[test]
    fn sections_are_read_by_name() {
        let t = "[default]\naws_access_key_id = A\n# c\n[profile x]\nRegion= eu-west-1\n[y]\nk=v\n";
        assert_eq!(
            section(t, "default"),
            [("aws_access_key_id".into(), "A".into())]
        );
        assert_eq!(
            section(t, "profile x"),
            [("region".into(), "eu-west-1".into())]
        );
        assert!(section(t, "z").is_empty());
    }
}
