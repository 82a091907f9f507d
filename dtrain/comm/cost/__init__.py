"""The cost layer: the alpha-beta-gamma model of a schedule (:mod:`.model`), its closed forms (:mod:`.forms`), the
measured rules for ``algorithm="auto"`` (:mod:`.rules`) and the calibration that fits the model (:mod:`.calibrate`,
the one module here that needs torch; importing the package does not load it)."""
