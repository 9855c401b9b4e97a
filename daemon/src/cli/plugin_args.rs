//! `--plugin-arg KEY=VALUE` (or `TRAINERD_PLUGIN_ARGS`), the flags of every command that loads a
//! plugin, made into the plugin's [`PluginArgs`].

use trainerd_sdk::PluginArgs;

/// `--plugin-arg KEY=VALUE`, for every command that loads a plugin.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct PluginArgFlags {
    /// A setting for the plugin, as KEY=VALUE; repeatable. `trainerd plugin check` lists the
    /// keys a plugin accepts. Without any, the space-separated pairs of $TRAINERD_PLUGIN_ARGS.
    /// Every worker must give the same (a plugin may exempt a key, such as a file's path).
    #[arg(long = "plugin-arg", value_name = "KEY=VALUE")]
    pub plugin_arg: Vec<String>,
}

impl PluginArgFlags {
    /// The arguments: the flags, or else $TRAINERD_PLUGIN_ARGS.
    pub fn parse(&self) -> anyhow::Result<PluginArgs> {
        if !self.plugin_arg.is_empty() {
            return PluginArgs::parse(&self.plugin_arg).map_err(anyhow::Error::msg);
        }
        let env = std::env::var("TRAINERD_PLUGIN_ARGS").unwrap_or_default();
        let items: Vec<&str> = env.split_whitespace().collect();
        PluginArgs::parse(&items).map_err(|e| anyhow::anyhow!("TRAINERD_PLUGIN_ARGS: {e}"))
    }

    /// The flags that give `args` to a child `trainerd`.
    pub fn to_flags(args: &PluginArgs) -> Vec<String> {
        args.iter().map(|(k, v)| format!("--plugin-arg={k}={v}")).collect()
    }
}
