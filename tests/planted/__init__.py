"""Wrong solutions the graded checks must catch, each with the criterion that catches it."""
