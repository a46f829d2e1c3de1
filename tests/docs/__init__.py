"""The docs stay true: runnable snippets, links, the Note index and the README's example."""
