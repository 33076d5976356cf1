"""Starting runs across devices: the placement planner (`vlrl plan`) and the Ray launcher (`vlrl launch`)."""
