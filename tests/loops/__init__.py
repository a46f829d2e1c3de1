"""Training loops written the way users write them, sharded against plain torch on the
``tests.harness.user_loops`` harness: common recipes, model edits, other domains, Hugging Face models."""
