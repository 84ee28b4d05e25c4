"""The typed config: the whole run's (run_config, saved as run.yaml), the ``train:`` section
(train_config), and the strict coercion both are loaded through."""
