"""Functions the test pool runs on its ranks (tests import them and hand them to ``pool.run``)."""
