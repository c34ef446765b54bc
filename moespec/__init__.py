"""moespec: the MoE training specification shared by the trainer, autotune and tracelens (pure Python:
no torch). ``yaml_bounded``: the one YAML loader for every file and value a user hands the project."""
