"""The config at the edges: the schema, composing outside a run, Hydra's resolvers."""
